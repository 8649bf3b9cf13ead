package tracing_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
)

func TestInjectExtractRoundTrip(t *testing.T) {
	t.Parallel()
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)

	m := &transport.Message{Headers: []transport.Header{{Key: "tipus", Value: "comanda.creada"}}}
	tracing.Inject(ctx, m)
	if v, ok := m.Header("traceparent"); !ok || v != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" {
		t.Fatalf("traceparent %q", v)
	}
	got := trace.SpanContextFromContext(tracing.Extract(context.Background(), m))
	if got.TraceID() != tid || got.SpanID() != sid {
		t.Fatalf("extracted %v", got)
	}
	empty := &transport.Message{}
	tracing.Inject(context.Background(), empty)
	if len(empty.Headers) != 0 {
		t.Fatalf("injected without a span: %v", empty.Headers)
	}
}

// A malformed traceparent/tracestate never fails a message: Extract returns
// the context unchanged (no span), it never panics.
func TestExtractIgnoresMalformedHeaders(t *testing.T) {
	t.Parallel()
	bad := []string{"", "x", "00-", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
		"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz", "\xff\xfe\x00", string(make([]byte, 1<<16))}
	for _, v := range bad {
		m := &transport.Message{Headers: []transport.Header{{Key: "traceparent", Value: v}, {Key: "tracestate", Value: "=,=\x00"}}}
		if sc := trace.SpanContextFromContext(tracing.Extract(context.Background(), m)); sc.IsValid() {
			t.Errorf("%q: extracted %v", v, sc)
		}
	}
}
