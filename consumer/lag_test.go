package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// lagOf returns km0_consumer_lag of (topic, partition 0) in reg, and
// whether the series exists.
func lagOf(t *testing.T, reg *prometheus.Registry, topic string) (float64, bool) {
	t.Helper()
	return gaugeOf(t, reg, consumer.MetricLag, topic)
}

// gaugeOf returns the gauge metric of (topic, partition 0) in reg, and
// whether the series exists.
func gaugeOf(t *testing.T, reg *prometheus.Registry, metric, topic string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"grup": group, "consumidor": name, "topic": topic, "particio": "0"}
	for _, mf := range mfs {
		if mf.GetName() != metric {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(want) {
				continue
			}
			for _, l := range m.GetLabel() {
				if want[l.GetName()] != l.GetValue() {
					continue series
				}
			}
			return m.GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// TestLagGaugeFollowsTheBacklog: 20 records on one partition, a handler
// let through 5 of them (batches of one) and then held: km0_consumer_lag is
// 15, the records behind the high watermark, and the 6th record's age is
// exported. Let through, both drop to 0; once the consumer stops, the
// partition is no longer its own and the series are gone.
func TestLagGaugeFollowsTheBacklog(t *testing.T) {
	t.Parallel()
	b := setupWith(t, kafkaembed.Config{Partitions: 1})
	const n, first = 20, 5
	evs := make([]event, n)
	for i := range evs {
		evs[i] = newEvent("k", comanda{ID: fmt.Sprint(i), N: i})
	}
	b.publishEvents(evs...)

	gate := make(chan struct{}, n)
	for range first {
		gate <- struct{}{}
	}
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		return effect(ctx, tx, m)
	})
	cfg.BatchSize = 1
	r := b.run(cfg)

	testkit.Eventually(t, time.Minute, "km0_consumer_lag 15 with 5 of 20 done", func() bool {
		v, ok := lagOf(t, b.reg, topic)
		return ok && v == n-first
	})

	if got := r.c.Stats().Processed; got != first {
		t.Fatalf("processed %d while the handler holds the 6th, want %d", got, first)
	}
	if age, ok := gaugeOf(t, b.reg, consumer.MetricOldest, topic); !ok || age <= 0 {
		t.Fatalf("km0_consumer_oldest_unprocessed_seconds %v (exported %v) with the 6th held, want > 0", age, ok)
	}
	for range n - first {
		gate <- struct{}{}
	}
	testkit.Eventually(t, time.Minute, "all 20 processed", func() bool { return r.c.Stats().Processed == n })
	testkit.Eventually(t, time.Minute, "km0_consumer_lag 0", func() bool {
		v, ok := lagOf(t, b.reg, topic)
		return ok && v == 0
	})

	if age, ok := gaugeOf(t, b.reg, consumer.MetricOldest, topic); !ok || age != 0 {
		t.Fatalf("km0_consumer_oldest_unprocessed_seconds %v (exported %v) with nothing left, want 0", age, ok)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if _, ok := lagOf(t, b.reg, topic); ok {
		t.Fatal("km0_consumer_lag of a partition no longer owned is still exported")
	}
	mfs, err := b.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if (mf.GetName() == consumer.MetricLag || mf.GetName() == consumer.MetricOldest) && len(mf.GetMetric()) > 0 {
			t.Fatalf("%s series after stop: %d, want 0", mf.GetName(), len(mf.GetMetric()))
		}
	}
	if got := b.effects(); got != n {
		t.Fatalf("effects %d, want %d", got, n)
	}
}
