package amqp_test

import (
	"context"
	"fmt"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// Ordered mode: the publisher keeps the topic as routing key and names each
// agregat_id's shard (Shard(key, 4)) in header particio; the consumer's
// topology (SourceConfig.Topology, what amqp.NewSource declares) routes each
// shard to its own queue <queue>.<i> through a headers exchange, and each
// queue has a single active consumer, so the events of one aggregate keep
// their order. Here a fresh exchange on the machine's broker. (A whole
// consumer over RabbitMQ: package consumer's Example_rabbitMQ.)
func ExampleShardedPublisher() {
	ctx := context.Background()
	conn, err := amqp.Dial(ctx, amqp.Config{URL: amqptest.URL()})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()
	exchange := fmt.Sprintf("km0.exemple-%d", time.Now().UnixNano())
	const topic, shards = "comandes.esdeveniments", 4
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: exchange}) // declares the exchange
	if err != nil {
		fmt.Println(err)
		return
	}
	queue := exchange + ".inventari"
	topo := amqp.SourceConfig{Conn: conn, Queue: queue, Exchange: exchange, RoutingKeys: []string{topic}, Shards: shards}.Topology()
	if err := conn.Declare(ctx, topo); err != nil {
		fmt.Println(err)
		return
	}
	defer func() {
		_ = conn.Do(ctx, func(ch *amqp091.Channel) error {
			for _, q := range topo.QueueNames() {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
			return ch.ExchangeDelete(exchange, false, false)
		})
	}()
	sharded := amqp.ShardedPublisher{Next: pub, Shards: shards}
	var msgs []*transport.Message
	for _, key := range []string{"P-2026-000123", "P-2026-000123", "P-2026-000124"} {
		msgs = append(msgs, &transport.Message{Topic: topic, Key: []byte(key),
			Value: []byte(`{"id_esdeveniment":"…","tipus":"comanda.creada","versio":1,"data_ms":0,"origen":"comandes","dades":{}}`)})
	}
	if err := sharded.Publish(ctx, msgs); err != nil { // nil: every message confirmed
		fmt.Println(err)
		return
	}
	for _, key := range []string{"P-2026-000123", "P-2026-000124"} {
		i := amqp.Shard([]byte(key), shards)
		var n int
		_ = conn.Do(ctx, func(ch *amqp091.Channel) error {
			q, err := ch.QueueDeclarePassive(amqp.ShardQueueName(queue, i), true, false, false, false, nil)
			n = q.Messages
			return err
		})
		fmt.Printf("%s → shard %d, %d message(s) there\n", key, i, n)
	}
	// Output:
	// P-2026-000123 → shard 3, 2 message(s) there
	// P-2026-000124 → shard 2, 1 message(s) there
}
