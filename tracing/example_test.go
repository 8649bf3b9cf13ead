package tracing_test

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
)

// The trace context travels with the event: the writer's span goes into the
// outbox row (Headers, for outbox.Event.Headers), the relay copies it onto
// the message (Inject does the same for a message built by hand), and the
// consumer continues the trace (ConsumerContext, which the consumer calls
// for every delivery). Here with a fixed span context and no TracerProvider
// registered: the spans record nothing, and the trace id still goes through.
func Example() {
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))

	// Producer: what an outbox row stores in capcaleres.
	fmt.Println("capcaleres:", tracing.Headers(ctx)["traceparent"])
	fmt.Println("untraced:", tracing.Headers(context.Background()) == nil)

	// On the wire.
	m := &transport.Message{Topic: "comandes.esdeveniments", Key: []byte("P-2026-000123")}
	tracing.Inject(ctx, m)
	tp, _ := m.Header("traceparent")
	fmt.Println("header:", tp)

	// Consumer: the handler's ctx is in the producer's trace.
	cctx, span := tracing.ConsumerContext(context.Background(), m, tracing.Delivery{System: tracing.SystemKafka,
		Destination: m.Topic, Group: "inventari", MessageID: "6f1c9e2a-0000-4000-8000-000000000001", Partition: 0, Offset: 7})
	defer tracing.End(span, nil)
	fmt.Println("consumer trace:", trace.SpanContextFromContext(cctx).TraceID())
	// Output:
	// capcaleres: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
	// untraced: true
	// header: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
	// consumer trace: 4bf92f3577b34da6a3ce929d0e0e4736
}
