package consumerbench_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/km0/km0/consumer/consumerbench"
	"github.com/km0/km0/internal/pgtest"
)

// BenchmarkConsume consumes 20,000 events per iteration, with 0% and 1%
// malformed-JSON poison, and reports healthy events per second.
//
//	go test -run '^$' -bench Consume -benchtime 1x ./consumer/consumerbench
func BenchmarkConsume(b *testing.B) {
	for _, rate := range []float64{0, 0.01} {
		b.Run(fmt.Sprintf("poison=%g", rate), func(b *testing.B) {
			var res consumerbench.Result
			for b.Loop() {
				var err error
				res, err = consumerbench.Run(context.Background(), consumerbench.Config{
					DatabaseURL: pgtest.URL(), N: 50_000, PoisonRate: rate, Batch: true})
				if err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(res.HealthyPerS, "healthy/s")
			b.ReportMetric(res.EventsPerS, "events/s")
		})
	}
}
