package amqp_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/testkit"
)

// The RabbitMQ consumer runs the handler in a consumer span, the child of
// the span named by the message's traceparent, with the semantic-convention
// attributes; Message.Context is the handler's ctx.
func TestConsumerSpanIsTheChildOfTheProducersSpan(t *testing.T) {
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev); _ = tp.Shutdown(context.Background()) })

	b := setup(t)
	var handled atomic.Value // trace.SpanContext of the handler's ctx
	startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if !trace.SpanContextFromContext(m.Context()).Equal(trace.SpanContextFromContext(ctx)) {
			return errors.New("Message.Context is not the handler's ctx")
		}
		handled.Store(trace.SpanContextFromContext(ctx))
		return recordEffect(ctx, tx, m, 0)
	}))
	m := event(t, b.queue, "k", 1)
	m.SetHeader("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	publish(t, b, m)
	testkit.Eventually(t, 10*time.Second, "the message handled", func() bool { n, _ := countEffects(t, b.db); return n == 1 })
	var s sdktrace.ReadOnlySpan
	testkit.Eventually(t, 10*time.Second, "its span ended", func() bool {
		for _, x := range sr.Ended() {
			if x.SpanKind() == trace.SpanKindConsumer && x.SpanContext().TraceID().String() == "4bf92f3577b34da6a3ce929d0e0e4736" {
				s = x
			}
		}
		return s != nil
	})

	if s.Parent().SpanID().String() != "00f067aa0ba902b7" || s.Name() != "process "+b.queue {
		t.Fatalf("span %q parent %v, want the child of 00f067aa0ba902b7", s.Name(), s.Parent().SpanID())
	}
	if got := handled.Load().(trace.SpanContext); !got.Equal(s.SpanContext()) {
		t.Fatalf("handler ctx span %v, want the consumer span %v", got.SpanID(), s.SpanContext().SpanID())
	}
	a := map[string]string{}
	for _, kv := range s.Attributes() {
		a[string(kv.Key)] = kv.Value.Emit()
	}
	if a["messaging.system"] != "rabbitmq" || a["messaging.consumer.group.name"] != "prova.efecte" || a["messaging.message.id"] == "" ||
		a["messaging.destination.name"] != b.queue || a["messaging.rabbitmq.destination.routing_key"] == "" {
		t.Fatalf("attributes %v", a)
	}
}
