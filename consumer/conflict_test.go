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
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/outcome"
)

// deadlock makes tx the victim of a real deadlock with a second transaction
// of pool and returns tx's error (SQLSTATE 40P01): the side transaction
// locks carbasso, tx locks vi-crianca, the side waits for vi-crianca, and
// tx then asks for carbasso. tx's deadlock_timeout is 10 ms and the side's
// is the server's (1 s), so tx runs the deadlock check first and is the one
// PostgreSQL rolls back.
func (b *bundle) deadlock(ctx context.Context, tx pgx.Tx) error {
	side, err := b.s.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer side.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck
	if _, err := side.Exec(ctx, `UPDATE estoc SET unitats = unitats WHERE producte = 'carbasso'`); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `SET LOCAL deadlock_timeout = '10ms'`); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `UPDATE estoc SET unitats = unitats WHERE producte = 'vi-crianca'`); err != nil {
		return err
	}
	sideDone := make(chan error, 1)
	pid := side.Conn().PgConn().PID()
	go func() {
		_, err := side.Exec(ctx, `UPDATE estoc SET unitats = unitats WHERE producte = 'vi-crianca'`)
		sideDone <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting bool
		if err := b.s.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)`, pid).Scan(&waiting); err != nil {
			return err
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("the side transaction never waited")
		}
		time.Sleep(time.Millisecond)
	}
	_, err = tx.Exec(ctx, `UPDATE estoc SET unitats = unitats WHERE producte = 'carbasso'`)
	if serr := <-sideDone; serr != nil {
		return fmt.Errorf("side transaction: %w", serr)
	}
	return err
}

// Proof of "a deadlock is rerun in place and spends no attempt": the
// handler's transaction is the victim of four real deadlocks in a row (more
// than any fixed budget of in-place repeats), with MaxAttempts 1, so one
// spent attempt would dead-letter the message. It ends applied once, at
// attempt 1, with nothing retried or dead-lettered, 4 conflicts in Stats
// and in km0_consumer_conflicts_total{sqlstate="40P01"}, each logged at
// warn with its SQLSTATE. Run with Handle and with HandleBatchOutcomes.
func TestDeadlockIsRerunInPlaceWithoutSpendingAnAttempt(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			b := setup(t)
			const victims = 4
			var calls atomic.Int64
			var attempts []int
			var codes []string
			h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				n := calls.Add(1)
				attempts = append(attempts, m.Attempt)
				if n <= victims {
					err := b.deadlock(ctx, tx)
					var pgErr *pgconn.PgError
					if errors.As(err, &pgErr) {
						codes = append(codes, pgErr.Code)
					}
					if err == nil {
						return errors.New("no deadlock")
					}
					return err
				}
				return effect(ctx, tx, m)
			}
			cfg := b.config(h)
			cfg.MaxAttempts = 1
			if batch {
				cfg.Handle = nil
				cfg.HandleBatchOutcomes = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) ([]error, error) {
					if len(msgs) != 1 {
						return nil, fmt.Errorf("%d messages", len(msgs))
					}
					// A deadlock aborts the transaction: it fails the batch.
					return nil, h(ctx, tx, msgs[0])
				}
			}
			b.publishEvents(newEvent("k", comanda{ID: "P-1", N: 1}))
			st := b.runUntil(cfg, "the message applied", func(s consumer.Stats) bool { return s.Processed+s.DeadLettered+s.Retried > 0 })
			if st.Processed != 1 || st.Retried != 0 || st.DeadLettered != 0 || st.Conflicts != victims {
				t.Fatalf("stats %+v, want 1 processed, 0 retried or dead-lettered, %d conflicts", st, victims)
			}
			if n := b.effects(); n != 1 {
				t.Fatalf("%d effects, want 1", n)
			}
			if len(attempts) != victims+1 || strings.Trim(fmt.Sprint(attempts), "[1 ]") != "" {
				t.Fatalf("handler attempts %v, want attempt 1 at each of %d calls", attempts, victims+1)
			}
			if len(codes) != victims || strings.Trim(fmt.Sprint(codes), "[40P1 ]") != "" {
				t.Fatalf("injected errors %v, want %d × 40P01", codes, victims)
			}
			if v := counterValue(t, b, consumer.MetricConflicts, "40P01"); v != victims {
				t.Fatalf("%s{sqlstate=40P01} = %v, want %d", consumer.MetricConflicts, v, victims)
			}
			if !b.logged("level=WARN", "transaction conflict", "sqlstate=40P01") {
				t.Fatalf("no warn line with the sqlstate:\n%s", b.logBuf.String())
			}
		})
	}
}

// counterValue returns the value of the registered counter name whose
// sqlstate label is code (0 if there is none).
func counterValue(t *testing.T, b *bundle, name, code string) float64 {
	t.Helper()
	mfs, err := b.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "sqlstate" && l.GetValue() == code {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// Proof of the per-message outcomes of HandleBatchOutcomes: in one
// transaction of four messages, the handler applies two, refuses one
// permanently and one transiently. The two commit with their keys; the
// permanent one is in the DLQ at attempt 1, the transient one in .retry at
// attempt 1, both without a key and without an effect; the transient one is
// then applied at attempt 2. The batch never fell back to Handle.
func TestBatchOutcomesRefuseSingleMessagesWithTheirOwnOutcome(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var singles, batches atomic.Int64
	var failedOnce atomic.Bool
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		singles.Add(1)
		return effect(ctx, tx, m)
	})
	cfg.HandleBatchOutcomes = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) ([]error, error) {
		batches.Add(1)
		outcomes := make([]error, len(msgs))
		for i, m := range msgs {
			var d comanda
			if err := m.Envelope.DataAs(&d); err != nil {
				return nil, err
			}
			switch {
			case d.N == 2:
				outcomes[i] = outcome.Permanentf("estoc_insuficient: formatge-curat")
			case d.N == 3 && failedOnce.CompareAndSwap(false, true):
				outcomes[i] = outcome.Transient(errors.New("mercat tancat"))
			default:
				if err := effect(ctx, tx, m); err != nil {
					return nil, err
				}
			}
		}
		return outcomes, nil
	}
	evs := []event{newEvent("k", comanda{ID: "P-1", N: 1}), newEvent("k", comanda{ID: "P-2", N: 2}),
		newEvent("k", comanda{ID: "P-3", N: 3}), newEvent("k", comanda{ID: "P-4", N: 4})}
	b.publishEvents(evs...)
	st := b.runUntil(cfg, "three applied and one dead letter", func(s consumer.Stats) bool { return s.Processed == 3 && s.DeadLettered == 1 })
	if st.Retried != 1 || singles.Load() != 0 {
		t.Fatalf("stats %+v, %d single calls; want 1 retried and no fallback", st, singles.Load())
	}
	if n := b.count(`SELECT count(*) FROM efectes`); n != 3 {
		t.Fatalf("%d effects, want 3", n)
	}
	for i, want := range []int{1, 0, 1, 1} {
		if n := b.count(`SELECT count(*) FROM missatges_processats WHERE id_missatge = $1`, evs[i].id); n != want {
			t.Fatalf("key of message %d recorded %d times, want %d", i+1, n, want)
		}
	}
	dl := b.read(topic+contract.DLQSuffix, 1)
	rt := b.read(topic+contract.RetrySuffix, 1)
	if len(dl) != 1 || hdr(dl[0], "id_esdeveniment") != evs[1].id || hdr(dl[0], "intents") != "1" ||
		!strings.HasPrefix(hdr(dl[0], "motiu"), "permanent: estoc_insuficient") {
		t.Fatalf("dead letters %d, first %s intents %s motiu %q", len(dl), hdr(dl[0], "id_esdeveniment"), hdr(dl[0], "intents"), hdr(dl[0], "motiu"))
	}
	if len(rt) != 1 || hdr(rt[0], "id_esdeveniment") != evs[2].id || hdr(rt[0], "intents") != "1" {
		t.Fatalf("retry copies %d, first %s intents %s", len(rt), hdr(rt[0], "id_esdeveniment"), hdr(rt[0], "intents"))
	}
}

// Proof of the same for a serialisation failure (SQLSTATE 40001): the
// consumer's pool runs REPEATABLE READ, and four times in a row a second
// transaction updates and commits the row the handler is about to update,
// after the consumer's transaction took its snapshot (the key insert). The
// message is applied once at attempt 1 with MaxAttempts 1, with 4 conflicts
// counted under sqlstate 40001.
func TestSerializationFailureIsRerunInPlaceWithoutSpendingAnAttempt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pcfg, err := pgxpool.ParseConfig(b.s.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	rr, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rr.Close)
	const victims = 4
	var calls atomic.Int64
	var attempts []int
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		attempts = append(attempts, m.Attempt)
		if calls.Add(1) <= victims {
			// Another transaction changes the row and commits after tx's snapshot.
			if _, err := b.s.Pool.Exec(ctx, `UPDATE estoc SET unitats = unitats + 1 WHERE producte = 'carbasso'`); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, `UPDATE estoc SET unitats = unitats - 1 WHERE producte = 'carbasso'`); err != nil {
			return err
		}
		return effect(ctx, tx, m)
	})
	cfg.Pool = rr
	cfg.MaxAttempts = 1
	b.publishEvents(newEvent("k", comanda{ID: "P-1", N: 1}))
	st := b.runUntil(cfg, "the message applied", func(s consumer.Stats) bool { return s.Processed+s.DeadLettered+s.Retried > 0 })
	if st.Processed != 1 || st.Retried != 0 || st.DeadLettered != 0 || st.Conflicts != victims {
		t.Fatalf("stats %+v, want 1 processed, 0 retried or dead-lettered, %d conflicts", st, victims)
	}
	if n, c := b.effects(), b.stock("carbasso"); n != 1 || c != 80+victims-1 {
		t.Fatalf("%d effects and carbasso %d, want 1 and %d", n, c, 80+victims-1)
	}
	if len(attempts) != victims+1 || strings.Trim(fmt.Sprint(attempts), "[1 ]") != "" {
		t.Fatalf("handler attempts %v, want attempt 1 at each of %d calls", attempts, victims+1)
	}
	if v := counterValue(t, b, consumer.MetricConflicts, "40001"); v != victims {
		t.Fatalf("%s{sqlstate=40001} = %v, want %d", consumer.MetricConflicts, v, victims)
	}
	if !b.logged("level=WARN", "transaction conflict", "sqlstate=40001") {
		t.Fatalf("no warn line with the sqlstate:\n%s", b.logBuf.String())
	}
}

// A HandleBatchOutcomes that fails the whole call (here: a result of the
// wrong length for a batch of four) makes the consumer run the messages one
// at a time; with Handle nil each runs as a batch of one of the same
// handler, whose refusal is then the message's own and keeps what the
// handler wrote for it. Ends: three applied, one dead-lettered at attempt 1,
// no key for it, its own write committed once.
func TestBatchOutcomesFailureFallsBackToOneMessageAtATime(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var wrongLength atomic.Int64
	cfg := b.config(nil)
	cfg.Handle = nil
	cfg.HandleBatchOutcomes = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) ([]error, error) {
		if len(msgs) > 1 {
			wrongLength.Add(1)
			return make([]error, len(msgs)-1), nil
		}
		var d comanda
		if err := msgs[0].Envelope.DataAs(&d); err != nil {
			return nil, err
		}
		if d.N == 2 {
			// What the handler writes for a refused message (a compensation
			// event, say) commits with the refusal, as in a batch.
			if _, err := tx.Exec(ctx, `UPDATE estoc SET unitats = unitats + 100 WHERE producte = 'carbasso'`); err != nil {
				return nil, err
			}
			return []error{outcome.Permanentf("estoc_insuficient: formatge-curat")}, nil
		}
		return nil, effect(ctx, tx, msgs[0])
	}
	evs := []event{newEvent("k", comanda{ID: "P-1", N: 1}), newEvent("k", comanda{ID: "P-2", N: 2}),
		newEvent("k", comanda{ID: "P-3", N: 3}), newEvent("k", comanda{ID: "P-4", N: 4})}
	b.publishEvents(evs...)
	st := b.runUntil(cfg, "three applied and one dead letter", func(s consumer.Stats) bool { return s.Processed == 3 && s.DeadLettered == 1 })
	if st.Retried != 0 || b.effects() != 3 || wrongLength.Load() != 1 {
		t.Fatalf("stats %+v, %d effects, %d failed batch calls", st, b.effects(), wrongLength.Load())
	}
	if n := b.count(`SELECT count(*) FROM missatges_processats WHERE id_missatge = $1`, evs[1].id); n != 0 {
		t.Fatal("the refused message's key was recorded")
	}
	if c := b.stock("carbasso"); c != 180 {
		t.Fatalf("carbasso %d, want 180: the refused message's own write committed once with its refusal", c)
	}
	if dl := b.read(topic+contract.DLQSuffix, 1); len(dl) != 1 || hdr(dl[0], "id_esdeveniment") != evs[1].id || hdr(dl[0], "intents") != "1" {
		t.Fatalf("dead letters %d", len(dl))
	}
	if !b.logged("level=WARN", "batch handler failed", "3 outcomes for 4 messages") {
		t.Fatalf("no warn line for the failed batch call:\n%s", b.logBuf.String())
	}
}
