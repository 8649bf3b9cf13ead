package relay_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
)

// BenchmarkRelay moves 20,000 pre-inserted rows (on 4,000 aggregates) per
// iteration to kfake with the relay's defaults (adaptive claim size and
// workers) and reports events/s. Filling the outbox is not timed. `km0 bench
// relay` is the full benchmark.
func BenchmarkRelay(b *testing.B) {
	const rows = 20_000
	bd := setup(b)
	cfg := bd.config()
	cfg.BatchSize, cfg.Workers = 0, 0
	cfg.PollInterval, cfg.RebalanceInterval = relay.PollIntervalDefault, relay.RebalanceIntervalDefault
	var published atomic.Int64
	var probe faults.Relay
	probe.AfterPublish = func(rows int) error { published.Add(int64(rows)); return nil }
	r := bd.newRelay(b, cfg)
	withProbes(r, probe)
	ctx, cancel := context.WithCancel(ctxFor(r))
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	var moved time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		fillOutbox(b, bd, rows, 4000)
		b.StartTimer()
		t0 := time.Now()
		for published.Load() < int64(rows*(i+1)) {
			time.Sleep(100 * time.Microsecond) // polling the outcome, not waiting for work
		}
		for bd.pending(b) > 0 { // the last mark commits just after its AfterPublish
			time.Sleep(100 * time.Microsecond)
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
