package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/testkit"
)

func order(key string, lines ...linia) event { return newEvent(key, comanda{ID: key, Linies: lines}) }

// At-most-once: the offset is committed before processing. Crash point:
// mid-transaction (as in the suite's CrashMidTransactionLeavesNothingAndProcessesOnceLater, consumer/consumertest). The message is lost: a new member of the
// group never sees it again, unlike at-least-once.
func TestAtMostOnceCommitsBeforeProcessingSoACrashLosesTheMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	lost := order("A-1", linia{"carbasso", 1})
	b.publishEvents(lost)
	cfg := b.config(inventari)
	cfg.Mode = consumer.AtMostOnce
	cfg.Hooks.BeforeTxCommit = func(context.Context, pgx.Tx, []*consumer.Message) error { return faults.ErrCrashed }
	first := b.run(cfg)
	if err := first.wait(t); !errors.Is(err, faults.ErrCrashed) {
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
	t.Parallel()
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
	testkit.Eventually(t, time.Minute, "the committer's one commit", func() bool { return b.committed(topic) == 5 })
	b.publishEvents(evs[5:]...)
	testkit.Eventually(t, time.Minute, "all 50 processed", func() bool { return r.c.Stats().Processed == 50 })
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
	testkit.Eventually(t, time.Minute, "the new event to be processed", func() bool { return again.c.Stats().Processed == 1 })
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
// message falls back to Handle one by one, and ends as the suite's BusinessFailureRollsBackTheKeyAndDeadLetters does.
func TestBatchHandlerFallsBackToHandleToIsolateTheFailure(t *testing.T) {
	t.Parallel()
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
	testkit.Eventually(t, time.Minute, "the healthy batch", func() bool { return r.c.Stats().Processed == 3 })
	if batches.Load() != 1 || singles.Load() != 0 {
		t.Fatalf("healthy batch: %d batch calls and %d single calls, want 1 and 0", batches.Load(), singles.Load())
	}

	bad := order("B-1", linia{"tomaquet-rosa", 1}, linia{"formatge-curat", 6})
	b.publishEvents(order("B-1", linia{"formatge-curat", 2}), bad, order("B-1", linia{"formatge-curat", 3}))
	testkit.Eventually(t, time.Minute, "the mixed batch", func() bool {
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
