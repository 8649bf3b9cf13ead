package relay_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport/amqp"
)

const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func tracedCtx(t testing.TB) context.Context {
	t.Helper()
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	return trace.ContextWithSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
}

func recordHeaders(r *kgo.Record) map[string][]string {
	h := map[string][]string{}
	for _, x := range r.Headers {
		h[x.Key] = append(h[x.Key], string(x.Value))
	}
	return h
}

// The relay publishes a row's capcaleres as record headers, after the
// contract's and never instead of them: an Enqueue with a traced ctx and a
// caller header; a row written by a plain INSERT that does not name the
// column (as the Python services do) goes out with the contract's headers
// only; a row some other writer gave bad capcaleres (a reserved name, a
// number, a null, a bool, an object, not an object) goes out all the same,
// with only the string entries that pass: a null is dropped, never published
// as an empty header.
func TestRelayPublishesCapcaleresAsHeaders(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	r := b.newRelay(t, b.config())

	traced := &outbox.Event{Aggregate: "comanda", AggregateID: "A", Type: "comanda.creada",
		Payload: relaytest.SeqPayload{Seq: 1}, Headers: map[string]string{"origen-peticio": "web"}}
	if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.Enqueue(tracedCtx(t), tx, traced) }); err != nil {
		t.Fatal(err)
	}
	if _, err := b.s.Pool.Exec(ctx, `INSERT INTO outbox (id, agregat, agregat_id, tipus, versio, carrega)
		VALUES ('0190a3b4-0000-7000-8000-000000000001', 'comanda', 'B', 'comanda.creada', 1, '{"seq":1}')`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.s.Pool.Exec(ctx, `INSERT INTO outbox (id, agregat, agregat_id, tipus, carrega, capcaleres) VALUES
		('0190a3b4-0000-7000-8000-000000000002', 'comanda', 'C', 'comanda.creada', '{"seq":1}',
		 '{"tipus": "fals", "id_esdeveniment": "fals", "x-death": "fals", "n": 1, "bo": "si",
		   "nul": null, "cert": true, "objecte": {"a": "b"}, "llista": ["c"]}'),
		('0190a3b4-0000-7000-8000-000000000003', 'comanda', 'D', 'comanda.creada', '{"seq":1}', '[1, 2]'),
		('0190a3b4-0000-7000-8000-000000000004', 'comanda', 'E', 'comanda.creada', '{"seq":1}', 'null')`); err != nil {
		t.Fatal(err)
	}
	if n := b.drainOnce(t, r); n != 5 {
		t.Fatalf("published %d rows, want 5", n)
	}
	byKey := map[string]map[string][]string{}
	for _, rec := range b.read(t, 5) {
		env, err := envelope.Decode(rec.Value)
		if err != nil {
			t.Fatal(err)
		}
		h := recordHeaders(rec)
		if len(h["tipus"]) != 1 || h["tipus"][0] != "comanda.creada" || len(h["id_esdeveniment"]) != 1 || h["id_esdeveniment"][0] != env.ID {
			t.Fatalf("key %s: contract headers %v", rec.Key, h)
		}
		byKey[string(rec.Key)] = h
	}
	if a := byKey["A"]; len(a) != 4 || a["traceparent"][0] != traceparent || a["origen-peticio"][0] != "web" {
		t.Fatalf("A (Enqueue, traced, one header): %v", a)
	}
	for _, k := range []string{"B", "D", "E"} {
		if len(byKey[k]) != 2 {
			t.Fatalf("%s: headers %v, want tipus and id_esdeveniment only", k, byKey[k])
		}
	}
	if c := byKey["C"]; len(c) != 3 || len(c["bo"]) != 1 || c["bo"][0] != "si" {
		t.Fatalf("C (bad capcaleres): %v, want tipus, id_esdeveniment and bo", c)
	}
}

// Over RabbitMQ the capcaleres travel as AMQP headers, and the consumer side
// reads the traceparent from them.
func TestRelayPublishesCapcaleresOverRabbitMQ(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.relay.capcaleres")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue} })
	if err := conn.Declare(ctx, amqp.Topology{Queues: []amqp.Queue{{Name: queue, Durable: true}}}); err != nil {
		t.Fatal(err)
	}
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := b.config()
	cfg.Publisher, cfg.Topic = pub, queue
	r := b.newRelay(t, cfg)
	e := &outbox.Event{Aggregate: "comanda", AggregateID: "A", Type: "comanda.creada", Payload: relaytest.SeqPayload{Seq: 1}}
	if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.Enqueue(tracedCtx(t), tx, e) }); err != nil {
		t.Fatal(err)
	}
	if n := b.drainOnce(t, r); n != 1 {
		t.Fatalf("published %d, want 1", n)
	}
	var d amqp091.Delivery
	var ok bool
	if err := conn.Do(ctx, func(ch *amqp091.Channel) (err error) { d, ok, err = ch.Get(queue, true); return err }); err != nil || !ok {
		t.Fatalf("get: %v (a message: %v)", err, ok)
	}
	if got, _ := d.Headers["traceparent"].(string); got != traceparent || d.Type != "comanda.creada" {
		t.Fatalf("AMQP type %q headers %v, want traceparent %s", d.Type, d.Headers, traceparent)
	}
	sc := trace.SpanContextFromContext(tracing.Extract(ctx, amqp.FromDelivery(&d)))
	if sc.SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("consumer side extracts %v", sc)
	}
}

// A relay run with a traced ctx publishes each row with its own row's trace
// (or none), never the relay's: the publishers inject the trace of their
// ctx, and the relay hides its own from them.
func TestRelayNeverStampsItsOwnTraceOnRows(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	r := b.newRelay(t, b.config())
	own := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	e := &outbox.Event{Aggregate: "comanda", AggregateID: "A", Type: "comanda.creada", Payload: relaytest.SeqPayload{Seq: 1},
		Headers: map[string]string{"traceparent": own}}
	if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.Enqueue(ctx, tx, e) }); err != nil {
		t.Fatal(err)
	}
	b.enqueue(t, "B", relaytest.SeqPayload{Seq: 1}) // untraced
	n, err := r.RunOnce(tracedCtx(t))               // the relay's own ctx is traced
	if err != nil || n != 2 {
		t.Fatalf("RunOnce: %d %v, want 2", n, err)
	}
	for _, rec := range b.read(t, 2) {
		h := recordHeaders(rec)
		switch string(rec.Key) {
		case "A":
			if len(h["traceparent"]) != 1 || h["traceparent"][0] != own {
				t.Fatalf("A: traceparent %v, want its row's %s", h["traceparent"], own)
			}
		case "B":
			if _, ok := h["traceparent"]; ok {
				t.Fatalf("B (untraced row): traceparent %v, want none", h["traceparent"])
			}
		}
	}
}
