package keyorder_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/keyorder"
)

// BenchmarkIsBlockedBatchOf1000HealthyKeys is a micro-benchmark of the
// healthy-key overhead of per-key order: one IsBlocked call for a batch of
// 1,000 keys of which none is blocked, while 1,000 other keys of the
// consumer are blocked (one indexed query per batch). It reports ns per
// message as well.
func BenchmarkIsBlockedBatchOf1000HealthyKeys(b *testing.B) {
	ctx := context.Background()
	bd := setup(b, keyorder.Config{})
	if err := pgx.BeginFunc(ctx, bd.pool, func(tx pgx.Tx) error {
		for i := range 1000 {
			if err := bd.store.MarkHeadBlocked(ctx, tx, consumidor, fmt.Sprintf("blocked-%04d", i), keyorder.Head{MessageID: fmt.Sprint(i), Reason: keyorder.ReasonRetry}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		b.Fatal(err)
	}
	if _, err := bd.pool.Exec(ctx, `ANALYZE claus_bloquejades`); err != nil {
		b.Fatal(err)
	}
	keys := make([]string, 1000)
	for i := range keys {
		keys[i] = fmt.Sprintf("P-2026-%06d", i)
	}
	b.ResetTimer()
	for b.Loop() {
		heads, err := bd.store.IsBlocked(ctx, bd.pool, consumidor, keys...)
		if err != nil || len(heads) != 0 {
			b.Fatalf("%v %v", heads, err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1000, "ns/message")
}
