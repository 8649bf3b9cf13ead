package amqp_test

import (
	"context"
	"io"
	"log/slog"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/km0/km0/consumer/consumertest"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/transporttest"
)

// TestPublisherConformance runs the publisher suite against the machine's
// RabbitMQ, or the broker KM0_TEST_AMQP_URL names. Messages go through the
// default exchange: Message.Topic names the queue.
func TestPublisherConformance(t *testing.T) {
	transporttest.Run(t, transporttest.Harness{
		// An AMQP header table is a map: one value per name, no order.
		Features: transporttest.Features{HeaderOrder: false, Unroutable: true},
		New:      amqpTarget,
	})
}

func amqpTarget(t *testing.T, gate *transporttest.Gate) transporttest.Target {
	reader := amqptest.Dial(t) // past the gate; holds the shared restart lock
	u, err := url.Parse(amqptest.URL())
	if err != nil {
		t.Fatalf("KM0_TEST_AMQP_URL: %v", err)
	}
	port := u.Port()
	if port == "" {
		port = "5672"
		if u.Scheme == "amqps" {
			port = "5671"
		}
	}
	u.Host = gate.Proxy(t, u.Hostname()+":"+port)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := amqp.Dial(ctx, amqp.Config{URL: u.String(), Name: "km0-test " + t.Name(),
		ReconnectMax: 200 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatalf("RabbitMQ is required and did not answer: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{MaxMessageBytes: transporttest.MaxBytes})
	if err != nil {
		t.Fatal(err)
	}
	create := func(queue string) {
		t.Helper()
		declareQueue(t, reader, queue)
	}
	read := func(queue string, n int, timeout time.Duration) []*transport.Message {
		var out []*transport.Message
		deadline := time.Now().Add(timeout)
		for {
			for _, d := range getAll(t, reader, queue) {
				out = append(out, amqp.FromDelivery(&d))
			}
			if len(out) >= n || time.Now().After(deadline) {
				return out
			}
			time.Sleep(10 * time.Millisecond) // polling the queue with a deadline
		}
	}
	q := amqptest.Name("t.conformance")
	create(q)
	return transporttest.Target{Publisher: pub, Topic: q, Create: create, Read: read}
}

// TestConsumerConformance runs the consumer suite on the RabbitMQ source,
// against the machine's RabbitMQ or the broker KM0_TEST_AMQP_URL names: a
// plain work queue (with several workers, so no order per key), its wait
// queues and its DLQ; and in ordered mode (shard queues with a single active
// consumer each), where order per key holds.
func TestConsumerConformance(t *testing.T) {
	f := consumertest.Features{
		RepeatedHeaders: false, // a header table holds one value per name
		NoOrderPerKey:   "a plain queue with several workers keeps no order per key; ordered mode does (the Ordered run)",
		// A permanent failure is a native nack to the DLX (CONTRACT.md).
		PermanentLettersCarryReason: false,
		DeadLetterExtra:             []string{amqp.HeaderOriginQueue},
	}
	t.Run("Plain", func(t *testing.T) {
		t.Parallel()
		consumertest.Run(t, consumertest.Harness{Features: f, New: func(t *testing.T) consumertest.Broker { return amqpBroker(t, 1, false) }})
	})
	t.Run("Ordered", func(t *testing.T) {
		t.Parallel()
		f := f
		f.OrderPerKey = true
		f.PerKeyEvents = 10_000
		consumertest.Run(t, consumertest.Harness{Features: f, New: func(t *testing.T) consumertest.Broker { return amqpBroker(t, 2, false) }})
	})
	// Ordered mode as the system runs it: published to a topic exchange with
	// the topic name as routing key, each shard reached by header particio.
	t.Run("OrderedExchange", func(t *testing.T) {
		t.Parallel()
		f := f
		f.OrderPerKey = true
		f.PerKeyEvents = 2_000 // the Ordered run takes 10,000
		consumertest.Run(t, consumertest.Harness{Features: f, New: func(t *testing.T) consumertest.Broker { return amqpBroker(t, 2, true) }})
	})
}

// amqpBroker is a work queue (shards > 1: its shard queues) and a publisher
// to it: through the default exchange, or with exchange through a topic
// exchange of the test's own with routing key topic.
func amqpBroker(t *testing.T, shards int, exchange bool) consumertest.Broker {
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.conformance")
	cfg := amqp.SourceConfig{Conn: conn, Queue: queue, Shards: shards}
	topic := queue // the default exchange: the routing key names the queue
	if exchange {
		cfg.Exchange, topic = amqptest.Name("t.conformance.esdeveniments"), "conformance.esdeveniments"
		cfg.RoutingKeys = []string{topic}
		amqptest.DeleteExchangesAtCleanup(t, cfg.Exchange)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	source := func(t *testing.T) transport.Source {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		src, err := amqp.NewSource(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		amqptest.DeleteQueuesAtCleanup(t, src.Queues)
		return src
	}
	source(t) // declares the work queue and its DLQ before anything is published
	next, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: cfg.Exchange})
	if err != nil {
		t.Fatal(err)
	}
	pub := amqp.ShardedPublisher{Next: next, Shards: shards}
	publish := func(t testing.TB, msgs ...*transport.Message) {
		t.Helper()
		out := make([]*transport.Message, len(msgs))
		for i, m := range msgs {
			c := *m
			c.Topic = topic
			out[i] = &c
		}
		if err := pub.Publish(context.Background(), out); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	var dead []*transport.Message
	return consumertest.Broker{
		Publish:          publish,
		PublishRetryCopy: func(t testing.TB, m *transport.Message) { publish(t, m) },
		Source:           source,
		Pending: func(t testing.TB) int {
			n := 0
			for i := range shards {
				q := queue
				if shards > 1 {
					q = amqp.ShardQueueName(queue, i)
				}
				n += amqptest.QueueLen(t, conn, q)
			}
			return n
		},
		DeadLetters: func(t testing.TB, n int) []*transport.Message {
			mu.Lock()
			defer mu.Unlock()
			deadline := time.Now().Add(20 * time.Second)
			for {
				for _, d := range getAll(t, conn, contract.DLQName(queue)) {
					dead = append(dead, amqp.FromDelivery(&d))
				}
				if len(dead) >= n || time.Now().After(deadline) {
					return dead
				}
				time.Sleep(10 * time.Millisecond) // polling the DLQ with a deadline
			}
		},
	}
}
