package cdc_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
)

// Switching modes with a writer running loses nothing, following
// docs/cdc.md (switching to and from the WAL mode): table (polling relay)
// → WAL (slot first, then the writer, then the table relay stopped once
// the table is drained, then the WAL relay) → table (the writer, then the
// WAL relay stopped once its slot passed the last message, then the polling
// relay); each drain is awaited only once the writer has committed in the
// new mode, so no transaction of the old one is still in flight. Every event reaches the topic, in commit order per aggregate.
func TestSwitchTableToWALAndBackWithAWriterRunningLosesNothing(t *testing.T) {
	t.Parallel()
	w := setupWAL(t, true)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	table := outbox.New(outbox.Config{Names: w.s.Names()})
	wal := w.ob
	var current atomic.Pointer[outbox.Outbox]
	current.Store(table)
	var written atomic.Int64
	seqs := map[string]int{}
	done := make(chan error, 1)
	var stopWriter atomic.Bool // not ctx: a cancelled commit may have committed
	go func() {                // one writer: its commit order is its write order
		for i := 0; !stopWriter.Load(); i++ {
			agg := string(rune('A' + i%10))
			seqs[agg]++
			seq := seqs[agg]
			err := pgx.BeginFunc(ctx, w.s.Pool, func(tx pgx.Tx) error {
				return current.Load().Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: agg, Type: "comanda.creada", Payload: relaytest.SeqPayload{Seq: seq}})
			})
			if err != nil {
				done <- err
				return
			}
			written.Add(1)
		}
		done <- nil
	}()
	grow := func(what string, by int64) {
		n := written.Load()
		testkit.Eventually(t, 10*time.Second, what, func() bool { return written.Load() >= n+by })
	}
	poll, err := relay.New(w.pollingConfig())
	if err != nil {
		t.Fatal(err)
	}
	stopPoll := start(t, poll)
	grow("events written in table mode", 30)
	// Table → WAL. The writer has switched once it committed in the new
	// mode: no transaction of the old one is in flight any more.
	w.createSlot(t)
	current.Store(wal)
	grow("the writer to commit in WAL mode", 2)
	testkit.Eventually(t, 10*time.Second, "the table drained", func() bool { return w.pending(t) == 0 })
	if err := stopPoll(); err != nil {
		t.Fatal(err)
	}
	stopWAL := start(t, newRelay(t, w.walConfig()))
	grow("events written in WAL mode", 30)
	// WAL → table.
	current.Store(table)
	grow("the writer to commit in table mode", 2)
	var end int64
	if err := w.s.Pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8").Scan(&end); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the WAL slot past the last message", func() bool { return w.walConfirmed(t) >= end })
	if err := stopWAL(); err != nil {
		t.Fatal(err)
	}
	poll2, err := relay.New(w.pollingConfig())
	if err != nil {
		t.Fatal(err)
	}
	start(t, poll2)
	grow("events written in table mode again", 30)
	stopWriter.Store(true)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the table drained", func() bool { return w.pending(t) == 0 })
	waitDistinct(t, w.b, seqs)
}
