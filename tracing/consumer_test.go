package tracing_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
)

// record installs a TracerProvider writing to an in-memory recorder as the
// global one for the test (tests using it do not run in parallel).
func record(t *testing.T) *tracetest.SpanRecorder {
	t.Helper()
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev); _ = tp.Shutdown(context.Background()) })
	return sr
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]string {
	m := map[attribute.Key]string{}
	for _, a := range s.Attributes() {
		m[a.Key] = a.Value.Emit()
	}
	return m
}

const producerTP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func TestConsumerContextIsTheChildOfTheProducer(t *testing.T) {
	sr := record(t)
	m := &transport.Message{Topic: "comandes.esdeveniments", Headers: []transport.Header{{Key: "tipus", Value: "comanda.creada"},
		{Key: "traceparent", Value: producerTP}}}
	ctx, span := tracing.ConsumerContext(context.Background(), m, tracing.Delivery{System: tracing.SystemKafka,
		Destination: m.Topic, Group: "inventari", MessageID: "e-1", Partition: 3, Offset: 42})
	if trace.SpanFromContext(ctx) != span {
		t.Fatal("ctx does not carry the consumer span")
	}
	tracing.End(span, errors.New("estoc_insuficient"))
	spans := sr.Ended()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1", len(spans))
	}
	s := spans[0]
	if s.Parent().SpanID().String() != "00f067aa0ba902b7" || s.SpanContext().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || !s.Parent().IsRemote() {
		t.Fatalf("parent %v trace %v: want the producer's span of its trace", s.Parent(), s.SpanContext().TraceID())
	}
	if s.Name() != "process comandes.esdeveniments" || s.SpanKind() != trace.SpanKindConsumer || s.Status().Code != codes.Error {
		t.Fatalf("name %q kind %v status %v", s.Name(), s.SpanKind(), s.Status())
	}
	want := map[attribute.Key]string{"messaging.system": "kafka", "messaging.operation.type": "process", "messaging.operation.name": "process",
		"messaging.destination.name": "comandes.esdeveniments", "messaging.consumer.group.name": "inventari", "messaging.message.id": "e-1",
		"messaging.destination.partition.id": "3", "messaging.kafka.offset": "42"}
	got := attrs(s)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	// The handler's ctx renders as the consumer span's traceparent: what
	// its own outbox events store.
	h := tracing.Headers(ctx)
	if h["traceparent"] != "00-"+s.SpanContext().TraceID().String()+"-"+s.SpanContext().SpanID().String()+"-01" {
		t.Fatalf("Headers(handler ctx) = %v", h)
	}
}

// Without an SDK (no TracerProvider registered) nothing is recorded, yet the
// handler's ctx still carries the producer's trace context, so a service in
// the middle that does not export spans does not cut the trace.
func TestConsumerContextWithoutAProviderStillPropagates(t *testing.T) {
	m := &transport.Message{Headers: []transport.Header{{Key: "traceparent", Value: producerTP}}}
	ctx, span := tracing.ConsumerContext(context.Background(), m, tracing.Delivery{System: tracing.SystemRabbitMQ, Destination: "q"})
	defer span.End()
	if got := tracing.Headers(ctx)["traceparent"]; got != producerTP {
		t.Fatalf("traceparent %q, want the producer's %q", got, producerTP)
	}
}

func TestBatchContextLinksEveryMessage(t *testing.T) {
	sr := record(t)
	var scs []trace.SpanContext
	var spans []trace.Span
	for _, tp := range []string{producerTP, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", ""} {
		m := &transport.Message{}
		if tp != "" {
			m.SetHeader("traceparent", tp)
		}
		_, s := tracing.ConsumerContext(context.Background(), m, tracing.Delivery{System: tracing.SystemKafka, Destination: "t"})
		scs, spans = append(scs, s.SpanContext()), append(spans, s)
	}
	_, batch := tracing.BatchContext(context.Background(), tracing.Delivery{System: tracing.SystemKafka, Destination: "t", Offset: -1}, scs)
	batch.End()
	for _, s := range spans {
		s.End()
	}
	var b sdktrace.ReadOnlySpan
	for _, s := range sr.Ended() {
		if attrs(s)["messaging.batch.message_count"] == "3" {
			b = s
		}
	}
	if b == nil {
		t.Fatal("no batch span")
	}
	if len(b.Links()) != 3 || b.Parent().IsValid() {
		t.Fatalf("batch span: %d links (want 3), parent %v (want none)", len(b.Links()), b.Parent())
	}
	for i, l := range b.Links() {
		if l.SpanContext.SpanID() != scs[i].SpanID() {
			t.Fatalf("link %d: %v, want %v", i, l.SpanContext.SpanID(), scs[i].SpanID())
		}
	}
	if _, ok := attrs(b)["messaging.kafka.offset"]; ok {
		t.Fatal("a batch span names one offset")
	}
}

// The untraced path of Enqueue (most writes) must cost nothing: no map, no
// allocation.
func TestHeadersWithoutATraceIsNilAndFree(t *testing.T) {
	ctx := context.Background()
	if h := tracing.Headers(ctx); h != nil {
		t.Fatalf("Headers = %v, want nil", h)
	}
	if n := testing.AllocsPerRun(100, func() { _ = tracing.Headers(ctx) }); n != 0 {
		t.Fatalf("%v allocations per call, want 0", n)
	}
}

func TestHTTPHandlerContinuesTheCallersTrace(t *testing.T) {
	sr := record(t)
	var inner map[string]string
	mux := http.NewServeMux()
	mux.HandleFunc("POST /comandes", func(w http.ResponseWriter, r *http.Request) {
		inner = tracing.Headers(r.Context())
		w.WriteHeader(http.StatusCreated)
	})
	srv := httptest.NewServer(tracing.HTTPHandler(mux))
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/comandes", strings.NewReader("{}"))
	req.Header.Set("traceparent", producerTP)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// A request without trace context starts a trace; a 404 has no route.
	resp, err = http.Post(srv.URL+"/res", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	spans := sr.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want 2", len(spans))
	}
	s := spans[0]
	if s.Name() != "POST /comandes" || s.SpanKind() != trace.SpanKindServer || s.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("span %q kind %v parent %v", s.Name(), s.SpanKind(), s.Parent())
	}
	if a := attrs(s); a["http.route"] != "/comandes" || a["http.response.status_code"] != "201" || a["http.request.method"] != "POST" {
		t.Fatalf("attributes %v", a)
	}
	if inner["traceparent"] != "00-4bf92f3577b34da6a3ce929d0e0e4736-"+s.SpanContext().SpanID().String()+"-01" {
		t.Fatalf("handler's trace context %v, want the server span's", inner)
	}
	if n := spans[1]; n.Name() != "POST" || n.Parent().IsValid() || attrs(n)["http.response.status_code"] != "404" {
		t.Fatalf("unrouted span %q parent %v attrs %v", n.Name(), n.Parent(), attrs(n))
	}
}

// BenchmarkHeadersUntraced is the cost tracing adds to an untraced Enqueue.
func BenchmarkHeadersUntraced(b *testing.B) {
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		_ = tracing.Headers(ctx)
	}
}
