package cdc_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/kafkatest"
)

// Crash point: the relay dies after the broker confirmed a batch and before
// its rows are marked (and so before its position is confirmed). Nothing is
// marked, the slot has not moved, and the next run republishes every row of
// the batch with the same id_esdeveniment, then marks them.
func TestCrashAfterBrokerConfirmBeforeMarkRepublishesSameIDs(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 20
	cfg := b.config()
	crashed := 0
	var fx faults.CDC
	fx.AfterPublish = func(rows int) error {
		crashed = rows
		return faults.ErrCrashed
	}
	fx.Streaming = func() {
		for i := 1; i <= n; i++ {
			b.enqueue(t, "P-1", seqPayload{Seq: i})
		}
	}
	r := newRelay(t, cfg)
	if err := runUntilError(t, withFaults{r, fx}, 20*time.Second); !errors.Is(err, faults.ErrCrashed) {
		t.Fatalf("Run: %v, want ErrCrashed", err)
	}
	if crashed == 0 {
		t.Fatal("the hook saw no rows")
	}
	first := b.read(t, crashed)
	if p := b.pending(t); p != n {
		t.Fatalf("%d pending after the crash, want %d (nothing marked)", p, n)
	}
	lsn := b.confirmedLSN(t)

	cfg = b.config()
	start(t, newRelay(t, cfg))
	waitFor(t, "every row marked", 20*time.Second, func() bool { return b.pending(t) == 0 })
	waitFor(t, "the slot to move past the batch", 10*time.Second, func() bool { return b.confirmedLSN(t) > lsn })
	recs := b.read(t, len(first)+n)
	perKey, copies := firstSeqs(t, recs)
	checkCommitOrder(t, perKey, map[string]int{"P-1": n})
	twice := 0
	for _, c := range copies {
		if c == 2 {
			twice++
		}
	}
	if len(copies) != n || twice != crashed {
		t.Fatalf("%d distinct ids, %d published twice; want %d and %d (the crashed batch, same ids)", len(copies), twice, n, crashed)
	}
}

// Crash point: the relay dies after a batch's rows were marked and before
// its position was confirmed to the server. The rows stay marked and the
// slot still points before them; the next run receives the transactions
// again and publishes each row that is not marked, with its id, and no
// marked row a second time: its catch-up's snapshot shows those
// transactions committed, and the stream skips them.
func TestCrashAfterMarkBeforeConfirmLosesNothingAndRepeatsNoMarkedRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 10
	cfg := b.config()
	var marked atomic.Int64
	var fx faults.CDC
	fx.AfterMark = func(rows int) error {
		marked.Store(int64(rows))
		return faults.ErrCrashed
	}
	var lsn int64
	fx.Streaming = func() {
		lsn = b.confirmedLSN(t)
		for i := 1; i <= n; i++ {
			b.enqueue(t, "P-1", seqPayload{Seq: i})
		}
	}
	r := newRelay(t, cfg)
	if err := runUntilError(t, withFaults{r, fx}, 20*time.Second); !errors.Is(err, faults.ErrCrashed) {
		t.Fatalf("Run: %v, want ErrCrashed", err)
	}
	m := int(marked.Load())
	if m == 0 || b.pending(t) != n-m {
		t.Fatalf("%d marked by the hook, %d pending; want some marked and the rest pending", m, b.pending(t))
	}
	if got := b.confirmedLSN(t); got != lsn {
		t.Fatalf("slot moved to %d, want it still at %d (nothing confirmed)", got, lsn)
	}
	rows, err := b.s.Pool.Query(context.Background(), "SELECT id::text FROM outbox WHERE publicat_en IS NOT NULL")
	if err != nil {
		t.Fatal(err)
	}
	markedIDs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var end int64
	if err := b.s.Pool.QueryRow(context.Background(), "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8").Scan(&end); err != nil {
		t.Fatal(err)
	}
	start(t, newRelay(t, b.config()))
	waitFor(t, "every row marked", 20*time.Second, func() bool { return b.pending(t) == 0 })
	// Past every transaction of the crashed run: the stream has delivered
	// them all again, and what was to be published twice is on the topic.
	waitFor(t, "the slot to pass the writes", 20*time.Second, func() bool { return b.confirmedLSN(t) >= end })
	recs := kafkatest.ReadAll(t, b.b, topic, n+m, 3*time.Second)
	perKey, copies := firstSeqs(t, recs)
	checkCommitOrder(t, perKey, map[string]int{"P-1": n})
	if len(copies) != n {
		t.Fatalf("%d distinct ids, want %d", len(copies), n)
	}
	for _, id := range markedIDs {
		if copies[id] != 1 {
			t.Fatalf("marked row %s published %d times, want once (the stream's copy of a marked row is skipped)", id, copies[id])
		}
	}
}

// The database goes away under the relay (its sessions are terminated) while
// writers write: it reconnects, takes the slot again, and nothing is lost or
// reordered.
func TestReconnectsAfterSessionsAreTerminated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 50)
	r := newRelay(t, b.config())
	start(t, r)
	ctx := context.Background()
	waitFor(t, "the relay to hold the slot", 10*time.Second, r.Active)
	done := make(chan error, 1)
	go func() { done <- w.run(ctx, 2, 100, 7) }()
	for range 3 {
		time.Sleep(30 * time.Millisecond) // let some rows through between the terminations (load, not a wait for work)
		if _, err := b.s.Pool.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()",
			"km0-relay-cdc-"+b.s.Name); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitFor(t, "every row published", 30*time.Second, func() bool { return b.pending(t) == 0 })
	want := w.counts(t)
	perKey, copies := firstSeqs(t, b.read(t, total(want)))
	if len(copies) != total(want) {
		t.Fatalf("%d distinct events, want %d", len(copies), total(want))
	}
	checkCommitOrder(t, perKey, want)
}
