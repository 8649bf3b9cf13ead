package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
)

func order(key string, lines ...linia) event { return newEvent(key, comanda{ID: key, Linies: lines}) }

// Crash point: the consumer dies after the DB transaction
// committed (key + stock decrement) and before the offset commit.
func TestCrashAfterDBCommitBeforeOffsetCommitIsAbsorbedAsDuplicate(t *testing.T) {
	b := setup(t)
	b.publishEvents(order("P-1", linia{"tomaquet-rosa", 3}))

	cfg := b.config(inventari)
	cfg.Hooks.AfterCommit = func(context.Context, []*consumer.Message) error { return consumer.ErrCrashed }
	first := b.run(cfg)
	if err := first.wait(t); !errors.Is(err, consumer.ErrCrashed) {
		t.Fatalf("first consumer: %v, want ErrCrashed", err)
	}
	if got := b.stock("tomaquet-rosa"); got != 117 {
		t.Fatalf("after the crash: stock %d, want 117 (the transaction committed)", got)
	}
	if got := b.committed(topic); got != 0 {
		t.Fatalf("offset committed before the crash: %d", got)
	}

	st := b.runUntil(b.config(inventari), "the redelivery to be reported as a duplicate", func(st consumer.Stats) bool { return st.Duplicates == 1 })
	if st.Processed != 0 || st.Duplicates != 1 {
		t.Fatalf("second consumer: %+v, want 0 processed and 1 duplicate", st)
	}
	if got := b.stock("tomaquet-rosa"); got != 117 {
		t.Fatalf("stock %d, want 117: decremented once", got)
	}
	if got := b.keys(); got != 1 {
		t.Fatalf("keys %d, want 1", got)
	}
	if got := b.committed(topic); got != 1 {
		t.Fatalf("committed offset %d, want 1 after the duplicate", got)
	}
}

// Crash point: mid-transaction, after the handler
// decremented the stock and the key was recorded, before COMMIT.
func TestCrashMidTransactionLeavesNothingAndProcessesOnceLater(t *testing.T) {
	b := setup(t)
	b.publishEvents(order("P-2", linia{"carbasso", 5}, linia{"vi-crianca", 10}))

	var insideTx atomic.Int64
	cfg := b.config(inventari)
	cfg.Hooks.BeforeTxCommit = func(ctx context.Context, tx pgx.Tx, _ []*consumer.Message) error {
		var n int64
		if err := tx.QueryRow(ctx, `SELECT unitats FROM estoc WHERE producte = 'carbasso'`).Scan(&n); err != nil {
			return err
		}
		insideTx.Store(n)
		return consumer.ErrCrashed
	}
	first := b.run(cfg)
	if err := first.wait(t); !errors.Is(err, consumer.ErrCrashed) {
		t.Fatalf("first consumer: %v, want ErrCrashed", err)
	}
	if insideTx.Load() != 75 {
		t.Fatalf("inside the transaction carbasso was %d, want 75 (the effect ran)", insideTx.Load())
	}
	if c, v, k := b.stock("carbasso"), b.stock("vi-crianca"), b.keys(); c != 80 || v != 200 || k != 0 {
		t.Fatalf("after the crash: carbasso %d vi %d keys %d, want 80 200 0 (nothing persists)", c, v, k)
	}

	st := b.runUntil(b.config(inventari), "the message to be processed", func(st consumer.Stats) bool { return st.Processed == 1 })
	if st.Processed != 1 || st.Duplicates != 0 {
		t.Fatalf("second consumer: %+v, want exactly 1 processed", st)
	}
	if c, v, k := b.stock("carbasso"), b.stock("vi-crianca"), b.keys(); c != 75 || v != 190 || k != 1 {
		t.Fatalf("carbasso %d vi %d keys %d, want 75 190 1", c, v, k)
	}
}

// Every event is published twice (back to back, so both
// copies land in one fetch, and again at the end): the end state equals a run
// where each event was published once.
func TestEveryEventPublishedTwiceEqualsPublishedOnce(t *testing.T) {
	var evs []event
	products := []string{"tomaquet-rosa", "carbasso", "formatge-fresc", "vi-crianca"}
	for i := range 40 {
		evs = append(evs, order(fmt.Sprintf("P-%d", i%7), linia{products[i%4], 1 + i%3}))
	}
	endState := func(b *bundle) string {
		var s []string
		rows, err := b.s.Pool.Query(context.Background(), `SELECT producte || '=' || unitats FROM estoc ORDER BY producte`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var v string
			if err := rows.Scan(&v); err != nil {
				t.Fatal(err)
			}
			s = append(s, v)
		}
		return strings.Join(s, " ") + fmt.Sprintf(" keys=%d", b.keys())
	}

	once := setup(t)
	once.publishEvents(evs...)
	once.runUntil(once.config(inventari), "single publication processed", func(st consumer.Stats) bool { return st.Processed == 40 })

	twice := setup(t)
	var doubled []event
	for i, e := range evs {
		doubled = append(doubled, e)
		if i%2 == 0 {
			doubled = append(doubled, e) // back to back
		}
	}
	for i, e := range evs {
		if i%2 == 1 {
			doubled = append(doubled, e) // much later
		}
	}
	twice.publishEvents(doubled...)
	st := twice.runUntil(twice.config(inventari), "double publication consumed", func(st consumer.Stats) bool { return st.Processed+st.Duplicates == 80 })
	if st.Processed != 40 || st.Duplicates != 40 {
		t.Fatalf("double publication: %+v, want 40 processed and 40 duplicates", st)
	}
	if a, b := endState(once), endState(twice); a != b {
		t.Fatalf("end states differ:\n once:  %s\n twice: %s", a, b)
	}
}

// Insufficient stock: the failing order's key and its
// partial effect roll back, its neighbours in the same transaction batch keep
// theirs, the failure is permanent and the message is in the DLQ at attempt 1.
func TestInsufficientStockRollsBackKeyAndGoesToDLQ(t *testing.T) {
	b := setup(t)
	a := order("P-7", linia{"formatge-curat", 2}, linia{"tomaquet-rosa", 1})
	bad := order("P-7", linia{"tomaquet-rosa", 1}, linia{"formatge-curat", 4}) // 3 left: fails after decrementing tomaquet
	c := order("P-7", linia{"formatge-curat", 3})
	b.publishEvents(a, bad, c)

	st := b.runUntil(b.config(inventari), "the three orders to be finished", func(st consumer.Stats) bool { return st.Processed+st.DeadLettered == 3 })
	if st.Processed != 2 || st.DeadLettered != 1 || st.Retried != 0 {
		t.Fatalf("stats %+v, want 2 processed, 1 dead-lettered, 0 retried (permanent: no retry)", st)
	}
	if f, tom := b.stock("formatge-curat"), b.stock("tomaquet-rosa"); f != 0 || tom != 119 {
		t.Fatalf("formatge-curat %d tomaquet-rosa %d, want 0 and 119 (the failed order decremented nothing)", f, tom)
	}
	if n := b.count(`SELECT count(*) FROM missatges_processats WHERE id_missatge = $1`, bad.id); n != 0 {
		t.Fatal("the failed order's key was not rolled back")
	}
	if n := b.keys(); n != 2 {
		t.Fatalf("keys %d, want 2", n)
	}
	dlq := b.read(topic+".dlq", 1)
	if len(dlq) != 1 {
		t.Fatalf("dlq has %d records, want 1", len(dlq))
	}
	d := dlq[0]
	if hdr(d, "id_esdeveniment") != bad.id || hdr(d, "intents") != "1" ||
		hdr(d, "motiu") != "permanent: estoc insuficient: formatge-curat" || string(d.Key) != "P-7" {
		t.Fatalf("dead letter: key %s headers %v", d.Key, d.Headers)
	}
}

// At-most-once: the offset is committed before processing. Crash point:
// mid-transaction (as in TestCrashMidTransactionLeavesNothingAndProcessesOnceLater). The message is lost: a new member of the
// group never sees it again, unlike at-least-once.
func TestAtMostOnceCommitsBeforeProcessingSoACrashLosesTheMessage(t *testing.T) {
	b := setup(t)
	lost := order("A-1", linia{"carbasso", 1})
	b.publishEvents(lost)
	cfg := b.config(inventari)
	cfg.Mode = consumer.AtMostOnce
	cfg.Hooks.BeforeTxCommit = func(context.Context, pgx.Tx, []*consumer.Message) error { return consumer.ErrCrashed }
	first := b.run(cfg)
	if err := first.wait(t); !errors.Is(err, consumer.ErrCrashed) {
		t.Fatalf("first consumer: %v, want ErrCrashed", err)
	}
	if got := b.committed(topic); got != 1 {
		t.Fatalf("committed %d before processing, want 1", got)
	}

	marker := order("A-1", linia{"vi-crianca", 1}) // same key: same partition, behind the lost one
	b.publishEvents(marker)
	cfg = b.config(inventari)
	cfg.Mode = consumer.AtMostOnce
	st := b.runUntil(cfg, "the marker to be processed", func(st consumer.Stats) bool { return st.Processed == 1 })
	if st.Processed != 1 || st.Duplicates != 0 {
		t.Fatalf("second consumer %+v: the lost message must not come back", st)
	}
	if c, v := b.stock("carbasso"), b.stock("vi-crianca"); c != 80 || v != 199 {
		t.Fatalf("carbasso %d vi-crianca %d, want 80 (lost) and 199", c, v)
	}
}

// A clean stop commits what was finished. The background committer commits
// once (the first 5 events) and is then held back for an hour, so only the
// commit at stop can cover the other 45; a new member of the group then sees
// none of them again.
func TestCleanStopCommitsFinishedWork(t *testing.T) {
	b := setup(t)
	var evs []event
	for i := range 50 {
		evs = append(evs, order("S-1", linia{"vi-crianca", 1 + i%2}))
	}
	cfg := b.config(inventari)
	cfg.BatchSize = 5
	cfg.CommitInterval = time.Hour
	r := b.run(cfg)
	b.publishEvents(evs[:5]...)
	eventually(t, "the committer's one commit", func() bool { return b.committed(topic) == 5 })
	b.publishEvents(evs[5:]...)
	eventually(t, "all 50 processed", func() bool { return r.c.Stats().Processed == 50 })
	if got := b.committed(topic); got != 5 {
		t.Fatalf("premise: committed %d before the stop, want 5", got)
	}
	if err := r.stop(); err != nil {
		t.Fatalf("clean stop: %v", err)
	}
	if got := b.committed(topic); got != 50 {
		t.Fatalf("committed %d after a clean stop, want 50", got)
	}
	again := b.run(b.config(inventari))
	b.publishEvents(order("S-1", linia{"carbasso", 1}))
	eventually(t, "the new event to be processed", func() bool { return again.c.Stats().Processed == 1 })
	if err := again.stop(); err != nil {
		t.Fatal(err)
	}
	if st := again.c.Stats(); st.Duplicates != 0 {
		t.Fatalf("after a clean stop the next member re-read %d finished messages", st.Duplicates)
	}
}

// inventariBatch is inventari for a whole transaction in one round trip (a
// pgx.Batch). It fails as a whole if any line lacks stock.
func inventariBatch(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
	b := &pgx.Batch{}
	for _, m := range msgs {
		var d comanda
		if err := m.Envelope.DataAs(&d); err != nil {
			return err
		}
		for _, l := range d.Linies {
			b.Queue(`UPDATE estoc SET unitats = unitats - $1 WHERE producte = $2 AND unitats >= $1`, l.Quantitat, l.Producte)
		}
	}
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	for range b.Len() {
		tag, err := br.Exec()
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return errors.New("estoc insuficient")
		}
	}
	return br.Close()
}

// With HandleBatch, a healthy batch takes one call; a batch with a failing
// message falls back to Handle one by one, and ends as TestInsufficientStockRollsBackKeyAndGoesToDLQ does.
func TestBatchHandlerFallsBackToHandleToIsolateTheFailure(t *testing.T) {
	b := setup(t)
	var batches, singles atomic.Int64
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		singles.Add(1)
		return inventari(ctx, tx, m)
	})
	cfg.HandleBatch = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		batches.Add(1)
		return inventariBatch(ctx, tx, msgs)
	}
	healthy := []event{order("B-1", linia{"vi-crianca", 1}), order("B-1", linia{"vi-crianca", 2}), order("B-1", linia{"carbasso", 3})}
	b.publishEvents(healthy...)
	r := b.run(cfg)
	eventually(t, "the healthy batch", func() bool { return r.c.Stats().Processed == 3 })
	if batches.Load() != 1 || singles.Load() != 0 {
		t.Fatalf("healthy batch: %d batch calls and %d single calls, want 1 and 0", batches.Load(), singles.Load())
	}

	bad := order("B-1", linia{"tomaquet-rosa", 1}, linia{"formatge-curat", 6})
	b.publishEvents(order("B-1", linia{"formatge-curat", 2}), bad, order("B-1", linia{"formatge-curat", 3}))
	eventually(t, "the mixed batch", func() bool {
		st := r.c.Stats()
		return st.Processed == 5 && st.DeadLettered == 1
	})
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if singles.Load() == 0 {
		t.Fatal("the failing batch did not fall back to Handle")
	}
	if f, tom, v, c := b.stock("formatge-curat"), b.stock("tomaquet-rosa"), b.stock("vi-crianca"), b.stock("carbasso"); f != 0 || tom != 120 || v != 197 || c != 77 {
		t.Fatalf("stock formatge %d tomaquet %d vi %d carbasso %d, want 0 120 197 77", f, tom, v, c)
	}
	if n := b.count(`SELECT count(*) FROM missatges_processats WHERE id_missatge = $1`, bad.id); n != 0 {
		t.Fatal("the failed order's key was not rolled back")
	}
}
