package outbox_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
)

// BenchmarkEnqueue writes one comanda.creada per iteration inside one open
// transaction (rolled back at the end), so a round trip to PostgreSQL and the
// encoding are what is measured, not COMMIT.
func BenchmarkEnqueue(b *testing.B) { benchEnqueue(b, context.Background()) }

// BenchmarkEnqueueTraced is BenchmarkEnqueue with a sampled span in ctx:
// each row also stores its traceparent in capcaleres.
func BenchmarkEnqueueTraced(b *testing.B) { benchEnqueue(b, tracedCtx()) }

func benchEnqueue(b *testing.B, ctx context.Context) {
	s := pgtest.NewMigratedSchema(b)
	ob := outbox.New(outbox.Config{Names: s.Names()})
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // the rows are not wanted
	payload := []byte(`{"id":"P-2026-000123","client":"anna","mercat":"girona","linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450}]}`)
	b.ReportAllocs()
	for b.Loop() {
		e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-2026-000123", Type: "comanda.creada", Payload: payload}
		if err := ob.Enqueue(ctx, tx, e); err != nil {
			b.Fatal(err)
		}
	}
}

// Micro-benchmark (profiling aid, not a headline): decoding one WAL-mode
// message as the CDC relay does for every event, with a payload the size of
// the benchmarks' (a comanda with two lines) and trace headers.
func BenchmarkDecodeWAL(b *testing.B) {
	id := uuid.New()
	content, err := outbox.EncodeWAL(&outbox.Row{ID: id, Aggregate: "comanda", AggregateID: "P-2026-000042",
		Type: "comanda.creada", Version: 1, CreatedAt: time.Now(),
		Payload: json.RawMessage(`{"id":"P-2026-000042","client":"anna","mercat":"girona","linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450},{"producte":"tomaquet-rosa","quantitat":1,"preu_centims":320}]}`),
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}})
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(content)))
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := outbox.DecodeWAL(content); err != nil {
			b.Fatal(err)
		}
	}
}
