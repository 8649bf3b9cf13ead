package outbox_test

import (
	"context"
	"testing"

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
