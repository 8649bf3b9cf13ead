package amqp_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// T1 on RabbitMQ: the publisher carries the caller's trace to the consumer,
// like the Kafka publisher, without writing into the caller's message.
func TestPublishCarriesTheCallersTrace(t *testing.T) {
	conn, q, pub := pubSetup(t, amqp.PublisherConfig{})
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
	m := event(t, q, "k", 1)
	before := len(m.Headers)
	if err := pub.Publish(ctx, []*transport.Message{m}); err != nil {
		t.Fatal(err)
	}
	if len(m.Headers) != before {
		t.Fatalf("Publish wrote into the caller's message: %v", m.Headers)
	}
	got := getAll(t, conn, q)
	if len(got) != 1 {
		t.Fatalf("queue holds %d messages, want 1", len(got))
	}
	sc := trace.SpanContextFromContext(tracing.Extract(context.Background(), amqp.FromDelivery(&got[0])))
	if sc.TraceID() != tid {
		t.Fatalf("consumer side trace %v, want %v", sc.TraceID(), tid)
	}
}
