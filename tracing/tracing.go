// Package tracing carries OpenTelemetry trace context across brokers: Inject
// writes the W3C `traceparent`/`tracestate` of a context into a message's
// headers, Extract restores it on the consuming side, so a consumer's spans
// join the producer's trace. It uses the globally registered propagator
// (otel.GetTextMapPropagator), falling back to W3C TraceContext when none is set.
package tracing

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/km0/km0/transport"
)

var fallback = propagation.TraceContext{}

func propagator() propagation.TextMapPropagator {
	p := otel.GetTextMapPropagator()
	if len(p.Fields()) == 0 {
		return fallback
	}
	return p
}

// carrier adapts transport.Message headers to propagation.TextMapCarrier.
type carrier struct{ m *transport.Message }

func (c carrier) Get(key string) string {
	v, _ := c.m.Header(key)
	return v
}

func (c carrier) Set(key, value string) { c.m.SetHeader(key, value) }

func (c carrier) Keys() []string {
	keys := make([]string, len(c.m.Headers))
	for i, h := range c.m.Headers {
		keys[i] = h.Key
	}
	return keys
}

// Inject writes ctx's trace context into m's headers. Without an active span
// it writes nothing.
func Inject(ctx context.Context, m *transport.Message) {
	propagator().Inject(ctx, carrier{m})
}

// Extract returns ctx carrying the trace context found in m's headers (ctx
// unchanged when there is none).
func Extract(ctx context.Context, m *transport.Message) context.Context {
	return propagator().Extract(ctx, carrier{m})
}
