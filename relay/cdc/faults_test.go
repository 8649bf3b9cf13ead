package cdc_test

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
)

// Crash point: the relay dies after the broker confirmed a batch and before
// its rows are marked (and so before its position is confirmed). Nothing is
// marked, the slot has not moved, and the next run republishes every row of
// the batch with the same id_esdeveniment, then marks them; with
// DeletePublished the same, and the rows are deleted instead.
func TestCrashAfterBrokerConfirmBeforeMarkRepublishesSameIDs(t *testing.T) {
	t.Parallel()
	for _, del := range []bool{false, true} {
		t.Run(markMode(del), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const n = 20
			cfg := b.config()
			cfg.DeletePublished = del
			crashed := 0
			var fx faults.CDC
			fx.AfterPublish = func(rows int) error {
				crashed = rows
				return faults.ErrCrashed
			}
			fx.Streaming = func() {
				for i := 1; i <= n; i++ {
					b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: i})
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
			if p, rows := b.pending(t), b.count(t, "SELECT count(*) FROM outbox"); p != n || rows != n {
				t.Fatalf("%d pending, %d rows after the crash, want %d and %d (nothing marked or deleted)", p, rows, n, n)
			}
			lsn := b.confirmedLSN(t)

			cfg = b.config()
			cfg.DeletePublished = del
			start(t, newRelay(t, cfg))
			testkit.Eventually(t, 20*time.Second, "every row marked", func() bool { return b.pending(t) == 0 })
			testkit.Eventually(t, 10*time.Second, "the slot to move past the batch", func() bool { return b.confirmedLSN(t) > lsn })
			recs := b.read(t, len(first)+n)
			perKey, copies := relaytest.FirstSeqs(t, recs)
			relaytest.CheckCommitOrder(t, perKey, map[string]int{"P-1": n})
			twice := 0
			for _, c := range copies {
				if c == 2 {
					twice++
				}
			}
			if len(copies) != n || twice != crashed {
				t.Fatalf("%d distinct ids, %d published twice; want %d and %d (the crashed batch, same ids)", len(copies), twice, n, crashed)
			}
			checkMarkedOrDeleted(t, b, del, n)
		})
	}
}

// markMode names a subtest of both ways of marking.
func markMode(del bool) string {
	if del {
		return "DeletePublished"
	}
	return "publicat_en"
}

// checkMarkedOrDeleted asserts that the n published rows of the outbox are
// marked, or with del gone.
func checkMarkedOrDeleted(t *testing.T, b *bundle, del bool, n int) {
	t.Helper()
	marked, rows := b.count(t, "SELECT count(*) FROM outbox WHERE publicat_en IS NOT NULL"), b.count(t, "SELECT count(*) FROM outbox")
	if del && rows != 0 {
		t.Fatalf("DeletePublished: %d rows left in the outbox (%d marked), want none", rows, marked)
	}
	if !del && (marked != n || rows != n) {
		t.Fatalf("%d rows, %d marked; want %d and %d", rows, marked, n, n)
	}
}

// Crash point: the relay dies after a batch's rows were marked (or
// deleted, with DeletePublished) and before its position was confirmed to
// the server. The slot still points before them; the next run receives the
// transactions again and publishes each row that is still pending, with
// its id, and no marked or deleted row a second time: its catch-up's
// snapshot shows those transactions committed, and the stream skips them.
func TestCrashAfterMarkBeforeConfirmLosesNothingAndRepeatsNoMarkedRow(t *testing.T) {
	t.Parallel()
	for _, del := range []bool{false, true} {
		t.Run(markMode(del), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const n = 10
			cfg := b.config()
			cfg.DeletePublished = del
			var marked atomic.Int64
			var fx faults.CDC
			fx.AfterMark = func(rows int) error {
				marked.Store(int64(rows))
				return faults.ErrCrashed
			}
			var lsn int64
			var ids []string
			fx.Streaming = func() {
				lsn = b.confirmedLSN(t)
				for i := 1; i <= n; i++ {
					ids = append(ids, b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: i}).String())
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
			// Nothing of the batch confirmed: every insert of it is still
			// in the slot's stream. (The slot may have moved: on a server
			// other tests write to, the relay confirms keepalives'
			// positions before the batch.)
			if got := b.unconfirmedInserts(t); got != n {
				t.Fatalf("%d of the %d inserts still in the slot's stream after the crash, want all (nothing confirmed past the batch; slot at %d, was %d)", got, n, b.confirmedLSN(t), lsn)
			}
			rows, err := b.s.Pool.Query(context.Background(), "SELECT id::text FROM outbox WHERE publicat_en IS NULL")
			if err != nil {
				t.Fatal(err)
			}
			pending, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			var end int64
			if err := b.s.Pool.QueryRow(context.Background(), "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8").Scan(&end); err != nil {
				t.Fatal(err)
			}
			cfg = b.config()
			cfg.DeletePublished = del
			start(t, newRelay(t, cfg))
			testkit.Eventually(t, 20*time.Second, "every row marked", func() bool { return b.pending(t) == 0 })
			// Past every transaction of the crashed run: the stream has
			// delivered them all again, and what was to be published twice
			// is on the topic.
			testkit.Eventually(t, 20*time.Second, "the slot to pass the writes", func() bool { return b.confirmedLSN(t) >= end })
			recs := kafkatest.ReadTopic(t, b.b, topic, 60*time.Second)
			perKey, copies := relaytest.FirstSeqs(t, recs)
			relaytest.CheckCommitOrder(t, perKey, map[string]int{"P-1": n})
			if len(copies) != n {
				t.Fatalf("%d distinct ids, want %d", len(copies), n)
			}
			for _, id := range ids {
				if !slices.Contains(pending, id) && copies[id] != 1 {
					t.Fatalf("row %s, marked before the crash, published %d times, want once (the stream's copy is skipped)", id, copies[id])
				}
			}
			checkMarkedOrDeleted(t, b, del, n)
		})
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
	testkit.Eventually(t, 10*time.Second, "the relay to hold the slot", r.Active)
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, 2, 100, 7) }()
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
	testkit.Eventually(t, 30*time.Second, "every row published", func() bool { return b.pending(t) == 0 })
	want := w.Counts(t)
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, relaytest.Total(want)))
	if len(copies) != relaytest.Total(want) {
		t.Fatalf("%d distinct events, want %d", len(copies), relaytest.Total(want))
	}
	relaytest.CheckCommitOrder(t, perKey, want)
}
