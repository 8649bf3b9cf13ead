package amqp_test

import (
	"context"
	"io"
	"log/slog"
	"net/url"
	"testing"
	"time"

	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/amqp/amqptest"
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
