package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport"
)

const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func tracedCtx() context.Context {
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ts, _ := trace.ParseTraceState("km0=1")
	return trace.ContextWithSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, TraceState: ts}))
}

// capcaleres returns the column of the row with id, "" for NULL.
func capcaleres(t *testing.T, s *pgtest.Schema, id any) string {
	t.Helper()
	var c *string
	if err := s.Pool.QueryRow(context.Background(), "SELECT capcaleres::text FROM outbox WHERE id = $1", id).Scan(&c); err != nil {
		t.Fatal(err)
	}
	if c == nil {
		return ""
	}
	return *c
}

func decoded(t *testing.T, raw string) map[string]string {
	t.Helper()
	var m map[string]string
	if err := json.Unmarshal([]byte(raw), &m); err != nil {
		t.Fatalf("capcaleres %q: %v", raw, err)
	}
	return m
}

// Enqueue stores the W3C trace context of its ctx, merged with the event's
// own headers (which win); without either the column stays NULL.
func TestEnqueueStoresTheTraceContextOfCtx(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ob := outbox.New(outbox.Config{Names: s.Names()})
	write := func(ctx context.Context, h map[string]string) string {
		e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: []byte(`{}`), Headers: h}
		if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, e) }); err != nil {
			t.Fatal(err)
		}
		return capcaleres(t, s, e.ID)
	}
	if c := write(context.Background(), nil); c != "" {
		t.Fatalf("untraced, no headers: capcaleres %s, want NULL", c)
	}
	if c := write(context.Background(), map[string]string{}); c != "" {
		t.Fatalf("untraced, empty headers: capcaleres %s, want NULL", c)
	}
	if h := decoded(t, write(tracedCtx(), nil)); len(h) != 2 || h["traceparent"] != traceparent || h["tracestate"] != "km0=1" {
		t.Fatalf("traced: %v", h)
	}
	own := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	h := decoded(t, write(tracedCtx(), map[string]string{"traceparent": own, "canal": "web"}))
	if len(h) != 3 || h["traceparent"] != own || h["canal"] != "web" || h["tracestate"] != "km0=1" {
		t.Fatalf("traced with own headers: %v", h)
	}
}

// Every event of a batch gets ctx's trace context and its own headers; in a
// batch where no event has any, the column stays NULL.
func TestEnqueueBatchStoresHeadersPerEvent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ob := outbox.New(outbox.Config{Names: s.Names()})
	ctx := context.Background()
	plain := []*outbox.Event{
		{Aggregate: "producte", AggregateID: "b", Type: "estoc.actualitzat", Payload: []byte(`{}`)},
		{Aggregate: "producte", AggregateID: "a", Type: "estoc.actualitzat", Payload: []byte(`{}`)},
	}
	mixed := []*outbox.Event{
		{Aggregate: "producte", AggregateID: "z", Type: "estoc.actualitzat", Payload: []byte(`{}`), Headers: map[string]string{"traceparent": traceparent}},
		{Aggregate: "producte", AggregateID: "a", Type: "estoc.actualitzat", Payload: []byte(`{}`)},
		{Aggregate: "producte", AggregateID: "m", Type: "estoc.actualitzat", Payload: []byte(`{}`), Headers: map[string]string{"canal": "botiga"}},
	}
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		if err := ob.EnqueueBatch(ctx, tx, plain); err != nil {
			return err
		}
		return ob.EnqueueBatch(ctx, tx, mixed)
	}); err != nil {
		t.Fatal(err)
	}
	for _, e := range plain {
		if c := capcaleres(t, s, e.ID); c != "" {
			t.Fatalf("plain batch: %s", c)
		}
	}
	if h := decoded(t, capcaleres(t, s, mixed[0].ID)); len(h) != 1 || h["traceparent"] != traceparent {
		t.Fatalf("event 0 (z): %v", h)
	}
	if c := capcaleres(t, s, mixed[1].ID); c != "" {
		t.Fatalf("event 1 (a, no headers): %s", c)
	}
	if h := decoded(t, capcaleres(t, s, mixed[2].ID)); len(h) != 1 || h["canal"] != "botiga" {
		t.Fatalf("event 2 (m): %v", h)
	}
	traced := []*outbox.Event{
		{Aggregate: "producte", AggregateID: "y", Type: "estoc.actualitzat", Payload: []byte(`{}`)},
		{Aggregate: "producte", AggregateID: "x", Type: "estoc.actualitzat", Payload: []byte(`{}`), Headers: map[string]string{"canal": "web"}},
	}
	tctx := tracedCtx()
	if err := pgx.BeginFunc(tctx, s.Pool, func(tx pgx.Tx) error { return ob.EnqueueBatch(tctx, tx, traced) }); err != nil {
		t.Fatal(err)
	}
	if h := decoded(t, capcaleres(t, s, traced[0].ID)); len(h) != 2 || h["traceparent"] != traceparent {
		t.Fatalf("traced batch, event 0: %v", h)
	}
	if h := decoded(t, capcaleres(t, s, traced[1].ID)); len(h) != 3 || h["canal"] != "web" || h["traceparent"] != traceparent {
		t.Fatalf("traced batch, event 1: %v", h)
	}
}

// Headers that would pass for km0's own, or that the column or a broker
// cannot hold, are refused with ErrInvalid naming them, and nothing is
// written (the rest of a batch neither).
func TestEnqueueRefusesBadHeaders(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ob := outbox.New(outbox.Config{Names: s.Names()})
	ctx := context.Background()
	cases := []struct {
		h    map[string]string
		want string
	}{
		{map[string]string{"tipus": "fals"}, `"tipus" is reserved`},
		{map[string]string{"ID_ESDEVENIMENT": "x"}, "reserved"},
		{map[string]string{"intents": "1"}, "reserved"},
		{map[string]string{"no_abans": "1"}, "reserved"},
		{map[string]string{"correlacio": "c"}, "reserved"},
		{map[string]string{"x-death": "1"}, "reserved"},
		{map[string]string{"clau": "k"}, "reserved"},
		{map[string]string{"km0_signatura": "s"}, "reserved"},
		{map[string]string{"": "v"}, "empty name"},
		{map[string]string{"k": "a\x00b"}, "NUL"},
		{map[string]string{"k": "\xff"}, "UTF-8"},
		{map[string]string{"\xfe": "v"}, "UTF-8"},
		{map[string]string{strings.Repeat("n", 256): "v"}, "over the limit of 255"},
		{map[string]string{"gran": strings.Repeat("v", outbox.MaxHeadersBytes)}, "over the limit of 8192"},
	}
	for _, c := range cases {
		e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: []byte(`{}`), Headers: c.h}
		err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, e) })
		if !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want ErrInvalid with %q", c.h, err, c.want)
		}
		batch := []*outbox.Event{
			{Aggregate: "comanda", AggregateID: "P-0", Type: "comanda.creada", Payload: []byte(`{}`)},
			{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: []byte(`{}`), Headers: c.h},
		}
		err = pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error { return ob.EnqueueBatch(ctx, tx, batch) })
		if !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), "event 1") {
			t.Errorf("batch %q: %v, want ErrInvalid naming event 1", c.h, err)
		}
	}
	if n := count(t, s, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("%d rows written, want 0", n)
	}
}

func TestDecodeHeaders(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		raw  string
		want map[string]string
		err  bool
	}{
		{"", nil, false},
		{"null", nil, false},
		{"{}", nil, false},
		{`{"traceparent": "` + traceparent + `"}`, map[string]string{"traceparent": traceparent}, false},
		{`[1]`, nil, true},
		{`{"nul": null, "b": "ok"}`, map[string]string{"b": "ok"}, true},
		{`{"t": true, "o": {}, "l": [], "b": "ok"}`, map[string]string{"b": "ok"}, true},
		{`"x"`, nil, true},
		{`{"a": 1, "b": "ok", "tipus": "fals", "X-Death": "1", "clau": "k"}`, map[string]string{"b": "ok"}, true},
		{`{"a": "` + strings.Repeat("v", outbox.MaxHeadersBytes) + `"}`, nil, true},
	} {
		h, err := outbox.DecodeHeaders([]byte(c.raw))
		if (err != nil) != c.err || (err != nil && !errors.Is(err, outbox.ErrInvalid)) || len(h) != len(c.want) {
			t.Errorf("%.60s: %v, %v; want %v, error %v", c.raw, h, err, c.want, c.err)
			continue
		}
		for k, v := range c.want {
			if h[k] != v {
				t.Errorf("%.60s: %s = %q, want %q", c.raw, k, h[k], v)
			}
		}
	}
}

// AppendHeaders adds in name order and never replaces or duplicates a
// header already there, nor adds a reserved one.
func TestAppendHeadersNeverReplacesTheContracts(t *testing.T) {
	t.Parallel()
	hs := []transport.Header{{Key: "tipus", Value: "comanda.creada"}, {Key: "id_esdeveniment", Value: "e"}, {Key: "traceparent", Value: "mine"}}
	got := outbox.AppendHeaders(hs, map[string]string{"z": "1", "a": "2", "tipus": "fals", "traceparent": "theirs", "x-death": "1"})
	want := []transport.Header{hs[0], hs[1], hs[2], {Key: "a", Value: "2"}, {Key: "z", Value: "1"}}
	if len(got) != len(want) {
		t.Fatalf("%v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("%v, want %v", got, want)
		}
	}
}
