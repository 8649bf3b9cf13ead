package consumerbench_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/km0/km0/internal/bench/consumerbench"
	"github.com/km0/km0/internal/pgtest"
)

// BenchmarkConsume consumes 20,000 events per iteration, with 0% and 1%
// malformed-JSON poison, one statement per event (Handle) or per transaction
// (HandleBatch), and reports healthy events per second.
//
//	go test -run '^$' -bench Consume -benchtime 1x ./consumer/consumerbench
func BenchmarkConsume(b *testing.B) {
	for _, handler := range []string{"message", "batch"} {
		for _, rate := range []float64{0, 0.01} {
			b.Run(fmt.Sprintf("handler=%s/poison=%g", handler, rate), func(b *testing.B) {
				var res consumerbench.Result
				for b.Loop() {
					var err error
					res, err = consumerbench.Run(context.Background(), consumerbench.Config{
						DatabaseURL: pgtest.URL(), N: 20_000, PoisonRate: rate, Batch: handler == "batch"})
					if err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(res.HealthyPerS, "healthy/s")
				b.ReportMetric(res.EventsPerS, "events/s")
			})
		}
	}
}

// BenchmarkConsumeOrder compares per-key order mode with the unordered mode
// on healthy keys (no failure, so nothing is ever parked): what IsBlocked
// costs each batch. The ratio per-key/unordered of healthy/s is the figure
// in docs/benchmarks.md.
//
//	go test -run '^$' -bench ConsumeOrder -benchtime 3x ./consumer/consumerbench
func BenchmarkConsumeOrder(b *testing.B) {
	for _, order := range []string{"unordered", "per-key"} {
		b.Run("order="+order, func(b *testing.B) {
			var sum float64
			runs := 0
			for b.Loop() {
				res, err := consumerbench.Run(context.Background(), consumerbench.Config{
					DatabaseURL: pgtest.URL(), N: 20_000, PerKey: order == "per-key"})
				if err != nil {
					b.Fatal(err)
				}
				sum += res.HealthyPerS
				runs++
			}
			b.ReportMetric(sum/float64(runs), "healthy/s")
		})
	}
}

// A small run checks the bench itself: every healthy event processed once,
// every poison event dead-lettered, in both handler modes.
func TestRunCountsEveryEvent(t *testing.T) {
	for _, batch := range []bool{false, true} {
		res, err := consumerbench.Run(context.Background(), consumerbench.Config{
			DatabaseURL: pgtest.URL(), N: 2_000, PoisonRate: 0.05, Batch: batch, Concurrency: 2})
		if err != nil {
			t.Fatal(err)
		}
		if res.Processed != 1_900 || res.DeadLettered != 100 || res.EventsPerS <= 0 {
			t.Fatalf("batch=%v: %+v, want 1900 processed and 100 dead-lettered", batch, res)
		}
	}
	res, err := consumerbench.Run(context.Background(), consumerbench.Config{
		DatabaseURL: pgtest.URL(), N: 2_000, PerKey: true, Concurrency: 2})
	if err != nil || res.Processed != 2_000 || res.Order != "per-key" {
		t.Fatalf("per-key: %+v, %v; want 2000 processed in per-key order", res, err)
	}
}
