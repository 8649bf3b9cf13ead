package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// The defaults of the connection (Dial applies WithDefaults) and of the
// sources, subscriptions and publishers over it.
func ExampleConfig_WithDefaults() {
	c := amqp.Config{}.WithDefaults()
	fmt.Println("ReconnectMin", c.ReconnectMin == amqp.ReconnectMinDefault, c.ReconnectMin)
	fmt.Println("ReconnectMax", c.ReconnectMax == amqp.ReconnectMaxDefault, c.ReconnectMax)
	fmt.Println("Heartbeat", c.Heartbeat == amqp.HeartbeatDefault, c.Heartbeat)
	fmt.Println("SourceConfig.StandbyDelay", amqp.StandbyDelayDefault)
	fmt.Println("SourceConfig.WaitQueueExpiry", amqp.WaitQueueExpiryDefault)
	fmt.Println("SubscribeConfig.Workers", amqp.WorkersDefault)
	fmt.Println("PublisherConfig.MaxMessageBytes", amqp.MaxMessageBytesDefault)
	// Output:
	// ReconnectMin true 100ms
	// ReconnectMax true 5s
	// Heartbeat true 10s
	// SourceConfig.StandbyDelay 2s
	// SourceConfig.WaitQueueExpiry 30m0s
	// SubscribeConfig.Workers 1
	// PublisherConfig.MaxMessageBytes 16777216
}

// What a failed Publish can mean. A message no queue is bound for comes back
// as a *ReturnedError (errors.Is ErrUnroutable): declare the binding and
// publish again. ErrChannelLost: the broker's confirm never came, so the
// message may or may not be in the queue (publish again; consumers
// deduplicate). ErrBrokerUnavailable: RabbitMQ cannot be reached now.
// ErrConnClosed: the Conn was closed.
func ExamplePublisher_Publish_errors() {
	var p *amqp.Publisher // from amqp.NewPublisher
	err := p.Publish(context.Background(), []*transport.Message{{Topic: "comandes.esdeveniments", Key: []byte("c-1"), Value: []byte(`{}`)}})
	var returned *amqp.ReturnedError
	switch {
	case errors.Is(err, amqp.ErrUnroutable) && errors.As(err, &returned):
		for i, r := range returned.Returns {
			log.Printf("message %d returned: %s (routing key %q)", returned.Index[i], r.ReplyText, r.RoutingKey)
		}
	case errors.Is(err, amqp.ErrChannelLost), errors.Is(err, amqp.ErrBrokerUnavailable):
		log.Print("not confirmed; publish again later: ", err)
	case errors.Is(err, amqp.ErrConnClosed):
		log.Print("shutting down")
	}
}

// A Topology with an exchange-to-exchange binding: what comandes routes as
// comanda.* also reaches the analitica exchange, whose queue takes it all.
func ExampleExchangeBinding() {
	t := amqp.Topology{
		Exchanges: []amqp.Exchange{{Name: "comandes", Kind: "topic", Durable: true}, {Name: "analitica", Kind: "fanout", Durable: true}},
		Queues:    []amqp.Queue{{Name: "analitica.tot", Durable: true}},
		ExchangeBindings: []amqp.ExchangeBinding{
			{Destination: "analitica", Source: "comandes", Key: "comanda.*"},
		},
		Bindings: []amqp.Binding{{Queue: "analitica.tot", Exchange: "analitica"}},
	}
	fmt.Println(t.QueueNames())
	// Output:
	// [analitica.tot]
}

// A dead letter's x-death history, decoded from the delivery's headers; the
// message's key travels in the HeaderKey header.
func ExampleXDeaths() {
	h := amqp091.Table{
		amqp.HeaderKey: "c-1",
		"x-death": []any{amqp091.Table{"queue": "inventari.descompte_estoc.3", "reason": "rejected", "count": int64(3),
			"exchange": "km0.esdeveniments", "time": time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)}},
	}
	var deaths []amqp.XDeath = amqp.XDeaths(h)
	for _, d := range deaths {
		fmt.Println(h[amqp.HeaderKey], d.Queue, d.Reason, d.Count, d.Time.Format(time.RFC3339))
	}
	// Output:
	// c-1 inventari.descompte_estoc.3 rejected 3 2026-03-01T09:00:00Z
}

// A Source is the transport.Source of one work queue for the consumer.
func ExampleNewSource() {
	ctx := context.Background()
	conn, err := amqp.Dial(ctx, amqp.Config{Name: "inventari"})
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	var src *amqp.Source
	if src, err = amqp.NewSource(ctx, amqp.SourceConfig{Conn: conn, Queue: "inventari.descompte_estoc", Workers: 1}); err != nil {
		log.Fatal(err)
	}
	var _ transport.Source = src // what consumer.Config.Source takes
}
