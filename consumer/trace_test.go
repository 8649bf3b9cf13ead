package consumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/consumer"
)

// recordSpans installs an in-memory TracerProvider as the global one for
// the test. Spans of other tests running meanwhile may land in it too:
// assertions select spans by trace id.
func recordSpans(t *testing.T) *tracetest.SpanRecorder {
	t.Helper()
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev); _ = tp.Shutdown(context.Background()) })
	return sr
}

// producer i's trace context: trace id ...i, span id ...i.
func producerSC(i int) trace.SpanContext {
	tid, _ := trace.TraceIDFromHex(fmt.Sprintf("4bf92f3577b34da6a3ce929d0e0e%04x", i))
	sid, _ := trace.SpanIDFromHex(fmt.Sprintf("00f067aa0ba9%04x", i))
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled})
}

func tracedRecord(i int, key string) *kgo.Record {
	r := newEvent(key, comanda{ID: fmt.Sprint("P-", i), Linies: []linia{{"carbasso", 1}}, N: i}).record()
	sc := producerSC(i)
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: "traceparent",
		Value: []byte("00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01")})
	return r
}

// spansOf returns the ended consumer spans of producer i's trace.
func spansOf(sr *tracetest.SpanRecorder, i int) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range sr.Ended() {
		if s.SpanContext().TraceID() == producerSC(i).TraceID() && s.SpanKind() == trace.SpanKindConsumer {
			out = append(out, s)
		}
	}
	return out
}

// The handler runs in a consumer span that is the child of the producer's
// span named by the record's traceparent, and its ctx carries that span (so
// what the handler writes to its own outbox continues the trace).
func TestHandlerSpanIsTheChildOfTheProducersSpan(t *testing.T) {
	sr := recordSpans(t)
	b := setup(t)
	b.publish(tracedRecord(1, "P-1"), tracedRecord(2, "P-2"))
	var mu sync.Mutex
	inCtx := map[string]trace.SpanContext{}
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		inCtx[string(m.Key)] = trace.SpanContextFromContext(ctx)
		if !trace.SpanContextFromContext(m.Context()).Equal(inCtx[string(m.Key)]) {
			return fmt.Errorf("Message.Context is not the handler's ctx")
		}
		return nil
	})
	cfg.BatchSize = 1
	if st := b.runUntil(cfg, "both handled", func(s consumer.Stats) bool { return s.Processed >= 2 }); st.Processed != 2 {
		t.Fatalf("processed %d, want 2", st.Processed)
	}
	for i, key := range map[int]string{1: "P-1", 2: "P-2"} {
		spans := spansOf(sr, i)
		if len(spans) != 1 {
			t.Fatalf("producer %d: %d consumer spans, want 1", i, len(spans))
		}
		s := spans[0]
		if s.Parent().SpanID() != producerSC(i).SpanID() || s.Name() != "process "+topic {
			t.Fatalf("producer %d: span %q parent %v, want the child of %v", i, s.Name(), s.Parent().SpanID(), producerSC(i).SpanID())
		}
		if inCtx[key].SpanID() != s.SpanContext().SpanID() {
			t.Fatalf("%s: handler ctx span %v, want the consumer span %v", key, inCtx[key].SpanID(), s.SpanContext().SpanID())
		}
		a := map[string]string{}
		for _, kv := range s.Attributes() {
			a[string(kv.Key)] = kv.Value.Emit()
		}
		if a["messaging.system"] != "kafka" || a["messaging.consumer.group.name"] != group || a["messaging.destination.name"] != topic || a["messaging.kafka.offset"] == "" {
			t.Fatalf("attributes %v", a)
		}
	}
}

// A batch handler's messages each get their own consumer span, the child of
// their own producer, reachable as Message.Context; the batch's ctx is a
// batch span linked to every one of them.
func TestBatchHandlerKeepsEachMessagesTrace(t *testing.T) {
	sr := recordSpans(t)
	b := setup(t)
	const n = 5
	recs := make([]*kgo.Record, n)
	for i := range recs {
		recs[i] = tracedRecord(i+1, "P-1") // one key: one partition, one batch
	}
	b.publish(recs...)
	var mu sync.Mutex
	var batchSpans []trace.SpanContext
	perMsg := map[int]trace.SpanContext{}
	cfg := b.config(nil)
	cfg.HandleBatchOutcomes = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) ([]error, error) {
		mu.Lock()
		defer mu.Unlock()
		if len(msgs) > 1 {
			batchSpans = append(batchSpans, trace.SpanContextFromContext(ctx))
		}
		for _, m := range msgs {
			var c comanda
			if err := json.Unmarshal(m.Envelope.Data, &c); err != nil {
				return nil, err
			}
			perMsg[c.N] = trace.SpanContextFromContext(m.Context())
		}
		return nil, nil
	}
	if st := b.runUntil(cfg, "all handled", func(s consumer.Stats) bool { return s.Processed >= n }); st.Processed != n {
		t.Fatalf("processed %d, want %d", st.Processed, n)
	}
	for i := 1; i <= n; i++ {
		spans := spansOf(sr, i)
		if len(spans) != 1 || spans[0].Parent().SpanID() != producerSC(i).SpanID() {
			t.Fatalf("producer %d: %d consumer spans (want 1, the child of its producer)", i, len(spans))
		}
		if !perMsg[i].Equal(spans[0].SpanContext()) {
			t.Fatalf("message %d: Message.Context span %v, want its consumer span %v", i, perMsg[i].SpanID(), spans[0].SpanContext().SpanID())
		}
	}
	if len(batchSpans) == 0 {
		t.Fatal("no batch of more than one message: the test proves nothing about batch spans")
	}
	links := 0
	for _, s := range sr.Ended() {
		for _, bs := range batchSpans {
			if s.SpanContext().Equal(bs) {
				links += len(s.Links())
				if s.Parent().IsValid() {
					t.Fatalf("batch span has a parent %v", s.Parent())
				}
			}
		}
	}
	if links < 2 {
		t.Fatalf("batch spans have %d links in all, want one per message of each batch", links)
	}
}
