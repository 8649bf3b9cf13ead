package cdc_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
)

// BenchmarkCatchUpThenStream measures the two paths of the CDC relay with
// kfake in this process: b.N rows pending at the first start (published
// from the slot's snapshot), then b.N rows written while it streams.
// KM0_CDC_BENCH_BATCH sets Config.BatchSize.
func BenchmarkCatchUpThenStream(b *testing.B) {
	bu := setup(b)
	ctx := context.Background()
	write := func(from, n int) {
		for done := 0; done < n; {
			c := min(500, n-done)
			evs := make([]*outbox.Event, c)
			for i := range evs {
				evs[i] = &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-%07d", from+done+i), Type: "comanda.creada",
					Payload: map[string]any{"id": from + done + i, "client": "anna", "mercat": "girona"}}
			}
			if err := pgx.BeginFunc(ctx, bu.s.Pool, func(tx pgx.Tx) error { return bu.ob.EnqueueBatch(ctx, tx, evs) }); err != nil {
				b.Fatal(err)
			}
			done += c
		}
	}
	write(0, b.N)
	cfg := bu.config()
	if v, err := strconv.Atoi(os.Getenv("KM0_CDC_BENCH_BATCH")); err == nil {
		cfg.BatchSize = v
	}
	r := newRelay(b, cfg)
	b.ResetTimer()
	t0 := time.Now()
	start(b, r)
	testkit.Eventually(b, 5*time.Minute, "the catch-up", func() bool { return bu.pending(b) == 0 })
	catchUp := time.Since(t0)
	t1 := time.Now()
	write(b.N, b.N)
	written := time.Since(t1)
	testkit.Eventually(b, 5*time.Minute, "the stream", func() bool { return bu.pending(b) == 0 })
	stream := time.Since(t1)
	b.ReportMetric(float64(b.N)/catchUp.Seconds(), "catchup_rows/s")
	b.ReportMetric(float64(b.N)/stream.Seconds(), "stream_rows/s")
	b.ReportMetric(float64(b.N)/written.Seconds(), "write_rows/s")
}

// BenchmarkStream measures the stream alone: b.N rows are written after the
// slot exists while the relay holds back (its Streaming hook waits), then
// it drains them from the WAL.
func BenchmarkStream(b *testing.B) {
	bu := setup(b)
	ctx := context.Background()
	entered, release := make(chan struct{}), make(chan struct{})
	cfg := bu.config()
	fx := faults.CDC{Streaming: func() {
		close(entered)
		<-release
	}}
	r := newRelay(b, cfg)
	start(b, withFaults{r, fx})
	<-entered
	for done := 0; done < b.N; {
		c := min(500, b.N-done)
		evs := make([]*outbox.Event, c)
		for i := range evs {
			evs[i] = &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-%07d", done+i), Type: "comanda.creada",
				Payload: map[string]any{"id": done + i, "client": "anna", "mercat": "girona"}}
		}
		if err := pgx.BeginFunc(ctx, bu.s.Pool, func(tx pgx.Tx) error { return bu.ob.EnqueueBatch(ctx, tx, evs) }); err != nil {
			b.Fatal(err)
		}
		done += c
	}
	b.ResetTimer()
	t0 := time.Now()
	close(release)
	testkit.Eventually(b, 5*time.Minute, "the stream", func() bool { return bu.pending(b) == 0 })
	b.ReportMetric(float64(b.N)/time.Since(t0).Seconds(), "stream_rows/s")
}
