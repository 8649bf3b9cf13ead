package system_test

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/testkit"
)

// One trace from the HTTP request to the last consumer: POST /comandes runs
// in a server span; its comanda.creada carries that span's traceparent in
// comandes' outbox (capcaleres), the relay publishes it as a header,
// inventari's consumer span is its child; inventari's estoc.actualitzat
// carries the consumer span's context in inventari's own outbox, and
// cataleg's consumer span is the child of that. Spans go to OpenTelemetry's
// in-memory recorder; the test follows parent ids from cataleg back to the
// request.
func TestOneTraceFromPostComandesToCataleg(t *testing.T) {
	t.Parallel()
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev); _ = tp.Shutdown(context.Background()) })

	sys, _ := startWith(t, []string{comandes.Name, inventari.Name, cataleg.Name}, nil)
	t.Cleanup(sys.Close)
	r := postOrder(t, sys.Addrs()[comandes.Name], "k-traca-1",
		`{"id":"P-2026-000777","client":"anna","mercat":"girona","linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450}]}`)
	if r.status != http.StatusCreated {
		t.Fatalf("POST /comandes: %d %s", r.status, r.body)
	}
	var server sdktrace.ReadOnlySpan
	for _, s := range sr.Ended() {
		if s.Name() == "POST /comandes" {
			server = s
		}
	}
	if server == nil || server.SpanKind() != trace.SpanKindServer || server.Parent().IsValid() {
		t.Fatalf("no root server span POST /comandes: %v", server)
	}
	tid := server.SpanContext().TraceID()
	// byName returns the ended spans of the trace named name.
	byName := func(name string) []sdktrace.ReadOnlySpan {
		var out []sdktrace.ReadOnlySpan
		for _, s := range sr.Ended() {
			if s.SpanContext().TraceID() == tid && s.Name() == name {
				out = append(out, s)
			}
		}
		return out
	}
	testkit.Eventuallyf(t, 60*time.Second, "a span of cataleg's consumer in the request's trace", func() (bool, string) {
		return len(byName("process "+inventari.Topic)) > 0, fmt.Sprintf("spans of the trace: %v", names(sr, tid))
	})
	inv := byName("process " + comandes.Topic)
	cat := byName("process " + inventari.Topic)
	if len(inv) != 1 || len(cat) != 1 {
		t.Fatalf("%d inventari and %d cataleg consumer spans in the trace, want 1 and 1: %v", len(inv), len(cat), names(sr, tid))
	}
	if inv[0].Parent().SpanID() != server.SpanContext().SpanID() {
		t.Fatalf("inventari's span has parent %v, want the request's span %v", inv[0].Parent().SpanID(), server.SpanContext().SpanID())
	}
	if cat[0].Parent().SpanID() != inv[0].SpanContext().SpanID() {
		t.Fatalf("cataleg's span has parent %v, want inventari's consumer span %v", cat[0].Parent().SpanID(), inv[0].SpanContext().SpanID())
	}
	group := func(s sdktrace.ReadOnlySpan) string {
		for _, a := range s.Attributes() {
			if a.Key == "messaging.consumer.group.name" {
				return a.Value.AsString()
			}
		}
		return ""
	}
	if group(inv[0]) != inventari.ConsumerDecrement || group(cat[0]) != cataleg.ConsumerLowStock {
		t.Fatalf("groups %q and %q, want %q and %q", group(inv[0]), group(cat[0]), inventari.ConsumerDecrement, cataleg.ConsumerLowStock)
	}
}

func names(sr *tracetest.SpanRecorder, tid trace.TraceID) []string {
	var out []string
	for _, s := range sr.Ended() {
		if s.SpanContext().TraceID() == tid {
			out = append(out, s.Name())
		}
	}
	return out
}
