package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/relay"
)

// Kafka refuses every produce request (NOT_ENOUGH_REPLICAS, as when
// the cluster lost its replicas) while 4 writers keep committing; the relay
// rolls back and backs off, rows wait in the outbox; once Kafka is back every
// event arrives, and each aggregate's events are in commit order.
//
// Not parallel: run beside the other tests during a cold build of the
// whole suite it once found 8 of 100 aggregates with an event first
// published after a later one (e.g. [1 2 3 4 5 7 8 6 9 …]); 24 runs under
// CPU load did not repeat it. Until that is traced it runs alone, as it
// always had.
func TestKafkaOutageUnderLoadLosesNothingAndKeepsOrder(t *testing.T) {
	b := setup(t)
	w := newWriters(t, b, 100)
	cfg := b.config()
	cfg.PublishTimeout = 300 * time.Millisecond
	cfg.BatchSize = 400 // chunks of 100: a failure after a chunk's UPDATE was sent
	reg := prometheus.NewRegistry()
	cfg.Metrics = reg
	r := b.newRelay(t, cfg)
	start(t, r)
	ctx := context.Background()

	if err := w.Run(ctx, 4, 50, 1); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the first events published", func() bool { return b.pending(t) == 0 })

	// Kafka goes away: every produce request fails until Remove.
	outage := b.b.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	if err := w.Run(ctx, 4, 100, 2); err != nil {
		t.Fatal(err)
	}
	waitCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := outage.Wait(waitCtx, 3); err != nil {
		t.Fatalf("the relay did not try to produce during the outage: %v", err)
	}
	testkit.Eventually(t, 20*time.Second, "a failed cycle to be counted", func() bool {
		return metricValue(t, reg, relay.MetricFailures) >= 1
	})

	written := relaytest.Total(w.Counts(t))
	pendingDuring := b.pending(t)
	if pendingDuring < 4*100 {
		t.Fatalf("during the outage only %d rows pending; want at least the %d written during it", pendingDuring, 4*100)
	}
	outage.Remove()

	if err := w.Run(ctx, 4, 50, 3); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "every row published after the outage", func() bool { return b.pending(t) == 0 })
	want := w.Counts(t)
	n := relaytest.Total(want)
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, n))
	if len(copies) != n {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), n)
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	t.Logf("%d events (%d written before the outage ended, %d pending at its height), %d produce requests refused",
		n, written, pendingDuring, outage.Hits())
}

// metricValue sums the samples of the metric name in reg (0 if absent).
func metricValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	return v
}

// The relay's sessions (claim workers and LISTEN) are terminated by the
// server three times while writers commit; the relay reconnects by itself and
// nothing is lost or reordered.
func TestReconnectsAfterSessionsAreTerminated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 200)
	cfg := b.config()
	cfg.Workers = 2
	r := b.newRelay(t, cfg)
	start(t, r)
	ctx := context.Background()
	sessions := func() int {
		return b.count(t, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", cfg.ApplicationName)
	}
	killed := 0
	for round := range 3 {
		testkit.Eventually(t, 20*time.Second, "the relay's 3 sessions", func() bool { return sessions() == 3 })
		if err := w.Run(ctx, 4, 40, uint64(round)); err != nil {
			t.Fatal(err)
		}
		killed += b.count(t, "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1) k",
			cfg.ApplicationName)
	}
	if killed < 9 {
		t.Fatalf("terminated %d sessions, want 9", killed)
	}
	if err := w.Run(ctx, 4, 40, 9); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "every row published after the terminations", func() bool { return b.pending(t) == 0 })
	testkit.Eventually(t, 20*time.Second, "the relay's sessions back", func() bool { return sessions() == 3 })
	want := w.Counts(t)
	n := relaytest.Total(want)
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, n))
	if len(copies) != n {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), n)
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	if r.OwnedShards() != relay.ShardCount {
		t.Fatalf("after reconnecting the relay owns %d shards, want %d", r.OwnedShards(), relay.ShardCount)
	}
}
