package cdc_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
)

// First start with writers committing throughout: rows pending before the
// slot exists are published from the slot's own snapshot, the stream starts
// at its consistent point, and rows committed while the slot is being
// created land on exactly one side. Nothing is missing, nothing is published
// twice (no failure happened), each aggregate is in commit order.
func TestFirstStartWhileWritersWriteMissesAndRepeatsNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 200)
	ctx := context.Background()
	if err := w.Run(ctx, 4, 50, 11); err != nil { // pending before the first start
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, 4, 150, 12) }() // and during it
	r := newRelay(t, b.config())
	start(t, r)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "every row published", func() bool { return b.pending(t) == 0 })
	want := w.Counts(t)
	n := relaytest.Total(want)
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, n))
	if len(copies) != n {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), n)
	}
	for id, c := range copies {
		if c != 1 {
			t.Fatalf("event %s published %d times", id, c)
		}
	}
	relaytest.CheckCommitOrder(t, perKey, want)
}

// Switching a table polling → CDC → polling while writers write between the
// switches loses nothing and keeps commit order; publicat_en is the same
// state for both relays.
func TestSwitchPollingToCDCAndBackLosesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 100)
	ctx := context.Background()
	write := func(seed uint64) {
		t.Helper()
		if err := w.Run(ctx, 2, 40, seed); err != nil {
			t.Fatal(err)
		}
	}
	write(1)
	polling, err := relay.New(b.pollingConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(polling.Close)
	stop := start(t, polling)
	write(2)
	testkit.Eventually(t, 20*time.Second, "the polling relay to drain", func() bool { return b.pending(t) == 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	polling.Close()
	write(3) // pending while no relay runs

	r := newRelay(t, b.config())
	stop = start(t, r)
	write(4)
	testkit.Eventually(t, 20*time.Second, "the CDC relay to drain", func() bool { return b.pending(t) == 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	write(5)

	polling2, err := relay.New(b.pollingConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(polling2.Close)
	start(t, polling2)
	write(6)
	testkit.Eventually(t, 20*time.Second, "the polling relay to drain again", func() bool { return b.pending(t) == 0 })
	want := w.Counts(t)
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, relaytest.Total(want)))
	if len(copies) != relaytest.Total(want) {
		t.Fatalf("%d distinct events, want %d", len(copies), relaytest.Total(want))
	}
	relaytest.CheckCommitOrder(t, perKey, want)
}

// While a polling relay of the table runs, a CDC relay waits (they share the
// outbox's relay lock), and it takes over when the polling relay stops.
func TestCDCWaitsForAPollingRelayOfTheSameTable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	polling, err := relay.New(b.pollingConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(polling.Close)
	stop := start(t, polling)
	testkit.Eventually(t, 10*time.Second, "the polling relay to own its shards", func() bool { return polling.OwnedShards() == relay.ShardCount })
	r := newRelay(t, b.config())
	start(t, r)
	b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: 1})
	testkit.Eventually(t, 10*time.Second, "the polling relay to publish", func() bool { return b.pending(t) == 0 })
	if r.Active() || b.confirmedLSN(t) != 0 {
		t.Fatal("the CDC relay streams while a polling relay of the table runs")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	polling.Close()
	testkit.Eventually(t, 10*time.Second, "the CDC relay to take over", r.Active)
	b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: 2})
	testkit.Eventually(t, 10*time.Second, "the CDC relay to publish", func() bool { return b.pending(t) == 0 })
	perKey, _ := relaytest.FirstSeqs(t, b.read(t, 2))
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"P-1": 2})
}

// Batches larger than one marking statement (BatchSize 2,500): the
// catch-up's rows (marked by ctid) and the stream's (marked by id) are
// marked in several statements of one round trip; every row ends marked and
// on the topic exactly once, in commit order.
func TestBatchesLargerThanAMarkStatementAreMarkedWhole(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const n = 2500
	want := map[string]int{} // events written per aggregate
	write := func() {
		evs := make([]*outbox.Event, n)
		for i := range evs {
			agg := fmt.Sprintf("P-%d", i%7)
			want[agg]++
			evs[i] = &outbox.Event{Aggregate: "comanda", AggregateID: agg, Type: "comanda.creada",
				Payload: relaytest.SeqPayload{Seq: want[agg]}}
		}
		if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.EnqueueBatch(ctx, tx, evs) }); err != nil {
			t.Fatal(err)
		}
	}
	write() // pending at the first start: the catch-up
	cfg := b.config()
	cfg.BatchSize = n
	streaming := make(chan struct{})
	start(t, withFaults{newRelay(t, cfg), faults.CDC{Streaming: func() { close(streaming) }}})
	<-streaming
	write() // one transaction of n rows in the stream
	testkit.Eventually(t, 30*time.Second, "every row marked", func() bool { return b.pending(t) == 0 })
	if got := b.count(t, "SELECT count(*) FROM outbox WHERE publicat_en IS NOT NULL"); got != 2*n {
		t.Fatalf("%d rows marked, want %d", got, 2*n)
	}
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, 2*n))
	if len(copies) != 2*n {
		t.Fatalf("%d distinct events, want %d", len(copies), 2*n)
	}
	for id, c := range copies {
		if c != 1 {
			t.Fatalf("event %s published %d times", id, c)
		}
	}
	relaytest.CheckCommitOrder(t, perKey, want)
}
