package relay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
)

// leaseRelay starts a relay that can only be woken (the fallback poll and
// the rebalance are an hour away) and waits until it listens and owns every
// shard.
func leaseRelay(t *testing.T, b *bundle) {
	t.Helper()
	cfg := b.config()
	cfg.PollInterval, cfg.RebalanceInterval = time.Hour, time.Hour
	listening := make(chan struct{}, 1)
	r := b.newRelay(t, cfg)
	withProbes(r, faults.Relay{Listening: func() {
		select {
		case listening <- struct{}{}:
		default:
		}
	}})
	start(t, r)
	select {
	case <-listening:
	case <-time.After(20 * time.Second):
		t.Fatal("the relay never started listening")
	}
	relaytest.WaitFor(t, "the relay to own every shard", 20*time.Second, func() bool { return r.OwnedShards() == relay.ShardCount })
}

// countNotifications counts the notifications of b's outbox on a LISTEN
// session of its own; flush returns the count once every notification
// committed before the call has arrived (a marker sent after them).
func countNotifications(t *testing.T, b *bundle) (flush func() int64) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	conn, err := pgx.Connect(ctx, b.s.URL)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done; conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, "LISTEN km0_outbox"); err != nil {
		t.Fatal(err)
	}
	var n atomic.Int64
	marker := make(chan struct{}, 1)
	go func() {
		defer close(done)
		for {
			note, err := conn.WaitForNotification(ctx)
			if err != nil {
				return
			}
			switch note.Payload {
			case b.s.Name + ".outbox":
				n.Add(1)
			case "marker " + b.s.Name:
				marker <- struct{}{}
			}
		}
	}()
	return func() int64 {
		if _, err := b.s.Pool.Exec(context.Background(), "SELECT pg_notify('km0_outbox', $1)", "marker "+b.s.Name); err != nil {
			t.Fatal(err)
		}
		select {
		case <-marker:
		case <-time.After(10 * time.Second):
			t.Fatal("the marker notification never arrived")
		}
		return n.Load()
	}
}

// While events are committed one after another, the relay holds the notify
// lease and claims by itself: every event is published (the fallback poll
// is an hour away) and the writers send a small fraction of the
// notifications they would without it (one a commit).
func TestNotifyLeaseSparesTheWritersNotificationsWhileTheRelayIsBusy(t *testing.T) {
	t.Parallel()
	b := setup(t)
	leaseRelay(t, b)
	notes := countNotifications(t, b)
	const events = 200
	for i := 1; i <= events; i++ {
		b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: i})
	}
	relaytest.WaitFor(t, "every event published", 20*time.Second, func() bool { return b.pending(t) == 0 })
	if n := notes(); n > events/4 {
		t.Fatalf("%d notifications for %d commits: want at most %d (the relay held the lease)", n, events, events/4)
	}
	perKey, _ := relaytest.FirstSeqs(t, b.read(t, events))
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"P-1": events})
}

// A writer that inserted while the lease ran (and so sent no NOTIFY) and
// commits only after the lease has run out, when the relay would otherwise
// sleep until the fallback poll (an hour), is published at once: the relay
// waited for its transaction to end.
func TestNotifyLeaseLosesNoWakeUpWhenItEnds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	leaseRelay(t, b)
	ctx := context.Background()
	leased := func() bool {
		return b.count(t, "SELECT count(*) FROM km0_avisos WHERE taula = 'outbox' AND fins > clock_timestamp()") == 1
	}
	for i := 1; !leased(); i++ {
		if i > 2000 {
			t.Fatal("no lease after 2,000 commits one after another")
		}
		b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: i})
	}
	tx, err := b.s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	late := &outbox.Event{Aggregate: "comanda", AggregateID: "P-2", Type: "comanda.creada", Payload: relaytest.SeqPayload{Seq: 1}}
	if err := b.ob.Enqueue(ctx, tx, late); err != nil {
		t.Fatal(err)
	}
	if !leased() {
		t.Skip("the lease ran out between the check and the insert; the test proves nothing this time")
	}
	relaytest.WaitFor(t, "the lease to run out, 200 ms ago", 20*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM km0_avisos WHERE taula = 'outbox' AND fins < clock_timestamp() - interval '200 ms'") == 1
	})
	relaytest.WaitFor(t, "the events before it published", 20*time.Second, func() bool { return b.pending(t) == 0 })
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	relaytest.WaitFor(t, "the late writer's event published", 5*time.Second, func() bool { return b.pending(t) == 0 })
}
