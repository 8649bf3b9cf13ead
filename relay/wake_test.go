package relay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/relay"
)

// With polling effectively off (1 h), events committed one after another are
// still published: only the NOTIFY of the commit can have woken the relay.
// (The first event after LISTEN might ride on the wake-up that follows
// connecting; the later ones cannot.)
func TestNotifyWakesTheRelay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	cfg.PollInterval, cfg.RebalanceInterval = time.Hour, time.Hour
	listening := make(chan struct{}, 1)
	var probe faults.Relay
	probe.Listening = func() {
		select {
		case listening <- struct{}{}:
		default:
		}
	}
	r := b.newRelay(t, cfg)
	withProbes(r, probe)
	b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: 1})
	start(t, r)
	select {
	case <-listening:
	case <-time.After(20 * time.Second):
		t.Fatal("the relay never started listening")
	}
	published := func() bool { return b.pending(t) == 0 }
	testkit.Eventually(t, 20*time.Second, "the first event", published)
	for i := 2; i <= 6; i++ {
		b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: i})
		testkit.Eventually(t, 20*time.Second, "a notified event", published)
	}
	perKey, _ := relaytest.FirstSeqs(t, b.read(t, 6))
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"P-1": 6})
}

// Shards move fairly: one instance owns all 64; when a second joins each
// owns 32; when the first leaves the second owns all 64 again.
func TestShardsAreRebalancedWhenInstancesComeAndGo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	a, c := b.newRelay(t, cfg), b.newRelay(t, cfg)
	held := func() int {
		return b.count(t, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s USING (pid)
			WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.objid < 64 AND l.granted AND s.application_name = $1`,
			cfg.ApplicationName)
	}
	stopA := start(t, a)
	testkit.Eventually(t, 20*time.Second, "A to own every shard", func() bool { return a.OwnedShards() == relay.ShardCount })
	if _, err := a.RunOnce(context.Background()); !errors.Is(err, relay.ErrRunning) {
		t.Fatalf("RunOnce during Run: %v, want ErrRunning", err)
	}
	start(t, c)
	testkit.Eventually(t, 20*time.Second, "A and C to own 32 each", func() bool { return a.OwnedShards() == 32 && c.OwnedShards() == 32 })
	if h := held(); h != relay.ShardCount {
		t.Fatalf("%d shard locks held in the server, want %d", h, relay.ShardCount)
	}
	if err := stopA(); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "C to own every shard", func() bool { return c.OwnedShards() == relay.ShardCount })
	if h := held(); h != relay.ShardCount {
		t.Fatalf("%d shard locks held in the server, want %d", h, relay.ShardCount)
	}
}
