package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
)

// BenchmarkRelay moves 20,000 pre-inserted rows (on 4,000 aggregates) per
// iteration to kfake with BatchSize 1,000 and reports events/s. Filling the
// outbox is not timed. `km0 bench relay` is the full benchmark.
func BenchmarkRelay(b *testing.B) {
	const rows = 20_000
	bd := setup(b)
	cfg := bd.config()
	cfg.BatchSize, cfg.Workers = 1000, 2
	cfg.PollInterval, cfg.RebalanceInterval = relay.PollIntervalDefault, relay.RebalanceIntervalDefault
	r := bd.newRelay(b, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	var moved time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		fillOutbox(b, bd, rows, 4000)
		b.StartTimer()
		t0 := time.Now()
		for bd.pending(b) > 0 {
			time.Sleep(time.Millisecond) // polling the outcome, not waiting for work
		}
		moved += time.Since(t0)
	}
	b.ReportMetric(float64(rows*b.N)/moved.Seconds(), "events/s")
}

func fillOutbox(t testing.TB, bd *bundle, n, aggs int) {
	t.Helper()
	ctx := context.Background()
	events := make([]*outbox.Event, n)
	for i := range events {
		events[i] = &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-%06d", i%aggs), Type: "comanda.creada",
			Payload: []byte(`{"id":"P-2026-000123","client":"anna","mercat":"girona","linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450}]}`)}
	}
	if err := pgx.BeginFunc(ctx, bd.s.Pool, func(tx pgx.Tx) error { return bd.ob.EnqueueBatch(ctx, tx, events) }); err != nil {
		t.Fatal(err)
	}
}
