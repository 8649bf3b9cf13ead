package relay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/km0/km0/internal/faults"
)

// BenchmarkPruneBoundsTheOutbox (label: prune-bounded) writes 2,000 rows per
// iteration while the relay runs, with pruning off, on (retention 200 ms, a
// pass every 100 ms), and on with a VACUUM every 10 iterations (an autovacuum
// that keeps up), and reports the relay's events/s, the most rows seen in the
// outbox and its size (pg_total_relation_size) at the end. With pruning the
// row count stays flat as b.N grows, and with the vacuum the size too; off,
// both grow with b.N. Run e.g.
// go test -run '^$' -bench PruneBoundsTheOutbox -benchtime 150x ./relay/
func BenchmarkPruneBoundsTheOutbox(b *testing.B) {
	for _, c := range []struct {
		name       string
		on, vacuum bool
	}{{"pruning=on", true, false}, {"pruning=on+vacuum", true, true}, {"pruning=off", false, false}} {
		on := c.on
		b.Run(c.name, func(b *testing.B) {
			const rows = 2000
			bd := setup(b)
			cfg := bd.config()
			cfg.BatchSize, cfg.Workers = 0, 0
			if on {
				cfg.PruneOlderThan, cfg.PruneInterval = 200*time.Millisecond, 100*time.Millisecond
			}
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
			maxRows := 0
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				fillOutbox(b, bd, rows, 400)
				for published.Load() < int64(rows*(i+1)) {
					time.Sleep(100 * time.Microsecond) // polling the outcome, not waiting for work
				}
				moved += time.Since(t0)
				maxRows = max(maxRows, bd.count(b, "SELECT count(*) FROM outbox"))
				if c.vacuum && i%10 == 9 { // an autovacuum that keeps up
					if _, err := bd.s.Pool.Exec(context.Background(), "VACUUM outbox"); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(rows*b.N)/moved.Seconds(), "events/s")
			b.ReportMetric(float64(maxRows), "max-rows")
			b.ReportMetric(float64(bd.count(b, "SELECT pg_total_relation_size('outbox')::int")), "table-bytes")
		})
	}
}

// BenchmarkPublishedIndexWriterCost (label: prune-index) measures what the
// outbox_publicats index costs the writers and the relay's mark: per
// iteration 1,000 rows are enqueued in one transaction and then marked
// published, with the index and with it dropped.
func BenchmarkPublishedIndexWriterCost(b *testing.B) {
	for _, keep := range []bool{true, false} {
		name := "index=dropped"
		if keep {
			name = "index=kept"
		}
		b.Run(name, func(b *testing.B) {
			bd := setup(b)
			ctx := context.Background()
			if !keep {
				if _, err := bd.s.Pool.Exec(ctx, "DROP INDEX outbox_publicats"); err != nil {
					b.Fatal(err)
				}
			}
			var write, mark time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				fillOutbox(b, bd, 1000, 400)
				t1 := time.Now()
				if _, err := bd.s.Pool.Exec(ctx, "UPDATE outbox SET publicat_en = now() WHERE publicat_en IS NULL"); err != nil {
					b.Fatal(err)
				}
				write, mark = write+t1.Sub(t0), mark+time.Since(t1)
			}
			b.ReportMetric(float64(write.Microseconds())/float64(b.N), "write-µs/1000rows")
			b.ReportMetric(float64(mark.Microseconds())/float64(b.N), "mark-µs/1000rows")
		})
	}
}
