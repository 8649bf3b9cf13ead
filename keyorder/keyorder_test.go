package keyorder_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/keyorder"
)

func count(t *testing.T, b *bundle, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func begin(t *testing.T, b *bundle) pgx.Tx {
	t.Helper()
	tx, err := b.pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func block(t *testing.T, b *bundle, key, head string) {
	t.Helper()
	must(t, pgx.BeginFunc(context.Background(), b.pool, func(tx pgx.Tx) error {
		return b.store.MarkHeadBlocked(context.Background(), tx, consumidor, key, keyorder.Head{MessageID: head, Reason: keyorder.ReasonRetry})
	}))
}

func park(t *testing.T, b *bundle, m msg) {
	t.Helper()
	must(t, pgx.BeginFunc(context.Background(), b.pool, func(tx pgx.Tx) error {
		_, _, err := b.store.Park(context.Background(), tx, consumidor, m.key, m.parked())
		return err
	}))
}

// applyAll applies released messages through the inbox, as the consumer does.
func applyAll(t *testing.T, b *bundle, tx pgx.Tx, ps []keyorder.Parked) {
	t.Helper()
	ctx := context.Background()
	for _, p := range ps {
		m := fromParked(p)
		_, err := b.inbox.ProcessTx(ctx, tx, consumidor, p.ID, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO efectes (id, clau, sequencia) VALUES ($1, $2, $3)`, p.ID, m.key, m.seq)
			return err
		})
		must(t, err)
	}
}

// TestACrashBetweenParkAndCommitLosesNothingAndParksOnce: the transaction
// that parks a message dies before COMMIT (rolled back), so its offset was
// not committed and the message comes again: it is parked once. A
// redelivery after the COMMIT (the offset commit lost) is parked once too.
func TestACrashBetweenParkAndCommitLosesNothingAndParksOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, keyorder.Config{})
	block(t, b, "k", "k-00")
	m := msg{key: "k", seq: 1}

	tx := begin(t, b)
	p, dup, err := b.store.Park(ctx, tx, consumidor, "k", m.parked())
	must(t, err)
	if dup || p.Seq != 1 || p.State != keyorder.BehindRetry {
		t.Fatalf("parked %+v dup %v, want sequence 1 behind the retry", p, dup)
	}
	must(t, tx.Rollback(ctx)) // the crash
	if n := count(t, b, `SELECT count(*) FROM missatges_aparcats`); n != 0 {
		t.Fatalf("%d parked after the rollback, want 0", n)
	}

	park(t, b, m) // the redelivery
	tx = begin(t, b)
	p, dup, err = b.store.Park(ctx, tx, consumidor, "k", m.parked()) // redelivered after COMMIT
	must(t, err)
	must(t, tx.Commit(ctx))
	if !dup || p.ID != m.id() || string(p.Value) != string(m.parked().Value) || len(p.Headers) != 2 || p.Headers[1].Value != m.id() {
		t.Fatalf("second park of a parked message: %+v dup %v, want the stored copy, dup", p, dup)
	}
	park(t, b, msg{key: "k", seq: 2})
	seq, ok, err := b.store.Sequence(ctx, b.pool, consumidor, "k")
	must(t, err)
	if !ok || seq.Head.MessageID != "k-00" || len(seq.Behind) != 2 || seq.Behind[0].ID != "k-01" || seq.Behind[1].ID != "k-02" {
		t.Fatalf("sequence %+v, want head k-00 then k-01, k-02", seq)
	}
}

// TestACrashBetweenReleaseAndApplyLosesNothingAndAppliesOnce: the head
// succeeds and its transaction releases three parked messages; it dies (1)
// right after Release, (2) after applying them and before COMMIT. Each time
// everything is back: the key blocked, the three parked, nothing applied.
// The third attempt commits: each applied once, in order. The head's copy
// redelivered after that (offset commit lost) is a duplicate and releases
// nothing.
func TestACrashBetweenReleaseAndApplyLosesNothingAndAppliesOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, keyorder.Config{})
	block(t, b, "k", "k-00")
	for i := 1; i <= 3; i++ {
		park(t, b, msg{key: "k", seq: i})
	}
	state := func() (blocked, parked, applied int) {
		return count(t, b, `SELECT count(*) FROM claus_bloquejades`), count(t, b, `SELECT count(*) FROM missatges_aparcats`), count(t, b, `SELECT count(*) FROM efectes`)
	}
	for crash := range 2 {
		tx := begin(t, b)
		ps, err := b.store.Release(ctx, tx, consumidor, "k", "k-00")
		must(t, err)
		if len(ps) != 3 {
			t.Fatalf("released %d, want 3", len(ps))
		}
		if crash == 1 {
			applyAll(t, b, tx, ps)
		}
		must(t, tx.Rollback(ctx))
		if bl, pa, ap := state(); bl != 1 || pa != 3 || ap != 0 {
			t.Fatalf("after a crash at point %d: %d blocked, %d parked, %d applied; want 1, 3, 0", crash, bl, pa, ap)
		}
	}
	tx := begin(t, b)
	ps, err := b.store.Release(ctx, tx, consumidor, "k", "k-00")
	must(t, err)
	applyAll(t, b, tx, ps)
	must(t, tx.Commit(ctx))
	if bl, pa, ap := state(); bl != 0 || pa != 0 || ap != 3 {
		t.Fatalf("after the commit: %d blocked, %d parked, %d applied; want 0, 0, 3", bl, pa, ap)
	}
	var order []int
	rows, _ := b.pool.Query(ctx, `SELECT sequencia FROM efectes ORDER BY ordre`)
	order, err = pgx.CollectRows(rows, pgx.RowTo[int])
	must(t, err)
	if !slices.Equal(order, []int{1, 2, 3}) {
		t.Fatalf("applied in order %v, want [1 2 3]", order)
	}
	tx = begin(t, b)
	if _, err := b.store.Release(ctx, tx, consumidor, "k", "k-00"); !errors.Is(err, keyorder.ErrNotHead) {
		t.Fatalf("release by a redelivered head: %v, want ErrNotHead", err)
	}
}

// TestReleaseNextDrainsInOrderAndAFailureBecomesTheHead: one message at a
// time; the second released message fails: it becomes the head and the
// rest stay parked behind it, in order.
func TestReleaseNextDrainsInOrderAndAFailureBecomesTheHead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, keyorder.Config{})
	block(t, b, "k", "k-00")
	for i := 1; i <= 4; i++ {
		park(t, b, msg{key: "k", seq: i})
	}
	tx := begin(t, b)
	p, ok, err := b.store.ReleaseNext(ctx, tx, consumidor, "k", "k-00")
	must(t, err)
	if !ok || p.ID != "k-01" {
		t.Fatalf("first release %v %s, want k-01", ok, p.ID)
	}
	p, ok, err = b.store.ReleaseNext(ctx, tx, consumidor, "k", "k-01")
	must(t, err)
	if !ok || p.ID != "k-02" {
		t.Fatalf("second release %v %s, want k-02", ok, p.ID)
	}
	must(t, b.store.MarkHeadBlocked(ctx, tx, consumidor, "k", keyorder.Head{MessageID: "k-02", Reason: keyorder.ReasonRetry, LastError: "timeout"}))
	must(t, tx.Commit(ctx))
	seq, ok, err := b.store.Sequence(ctx, b.pool, consumidor, "k")
	must(t, err)
	if !ok || seq.Head.MessageID != "k-02" || seq.Head.LastError != "timeout" || len(seq.Behind) != 2 || seq.Behind[0].ID != "k-03" || seq.Behind[1].ID != "k-04" {
		t.Fatalf("sequence %+v, want head k-02 then k-03, k-04", seq)
	}
	tx = begin(t, b)
	var ids []string
	head := "k-02"
	for {
		p, ok, err := b.store.ReleaseNext(ctx, tx, consumidor, "k", head)
		must(t, err)
		if !ok {
			break
		}
		ids, head = append(ids, p.ID), p.ID
	}
	must(t, tx.Commit(ctx))
	if !slices.Equal(ids, []string{"k-03", "k-04"}) || count(t, b, `SELECT count(*) FROM claus_bloquejades`) != 0 {
		t.Fatalf("drained %v, want [k-03 k-04] and the key unblocked", ids)
	}
}

// TestDeadLetteredHeadDeadLettersOrParksWhatIsBehindAndItsReplayReleasesTheSequence:
// under DeadLetterBlocked, DeadLetterBehind returns the two parked messages
// (once: a second call returns none) and a later one is parked dead-lettered;
// a blocked letter replayed alone is re-parked in its place; replaying the
// head releases all three in order. Under StayParked nothing is returned and
// the messages wait as darrere_dlq.
func TestDeadLetteredHeadDeadLettersOrParksWhatIsBehindAndItsReplayReleasesTheSequence(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, pol := range []keyorder.Policy{keyorder.DeadLetterBlocked, keyorder.StayParked} {
		b := setup(t, keyorder.Config{Behind: pol})
		block(t, b, "k", "k-00")
		park(t, b, msg{key: "k", seq: 1})
		park(t, b, msg{key: "k", seq: 2})
		tx := begin(t, b)
		must(t, b.store.MarkHeadBlocked(ctx, tx, consumidor, "k", keyorder.Head{MessageID: "k-00", Reason: keyorder.ReasonDeadLettered, LetterID: "carta-1"}))
		dead, err := b.store.DeadLetterBehind(ctx, tx, consumidor, "k", "k-00")
		must(t, err)
		again, err := b.store.DeadLetterBehind(ctx, tx, consumidor, "k", "k-00")
		must(t, err)
		p3, _, err := b.store.Park(ctx, tx, consumidor, "k", msg{key: "k", seq: 3}.parked())
		must(t, err)
		must(t, tx.Commit(ctx))
		want, wantState := 2, keyorder.DeadLetteredBehind
		if pol == keyorder.StayParked {
			want, wantState = 0, keyorder.BehindDeadLetter
		}
		if len(dead) != want || len(again) != 0 || p3.State != wantState {
			t.Fatalf("policy %d: dead-lettered behind %d then %d, third parked %s; want %d, 0, %s", pol, len(dead), len(again), p3.State, want, wantState)
		}
		if want == 2 && (dead[0].ID != "k-01" || dead[1].ID != "k-02" || keyorder.BlockedReason("k-00") != "permanent: bloquejat_per_clau: behind k-00") {
			t.Fatalf("dead-lettered %s, %s; want k-01, k-02", dead[0].ID, dead[1].ID)
		}
		seq, _, err := b.store.Sequence(ctx, b.pool, consumidor, "k")
		must(t, err)
		if seq.Head.Reason != keyorder.ReasonDeadLettered || seq.Head.LetterID != "carta-1" || len(seq.Behind) != 3 {
			t.Fatalf("sequence %+v", seq)
		}
		for _, p := range seq.Behind {
			if p.State != wantState {
				t.Fatalf("%s is %s, want %s", p.ID, p.State, wantState)
			}
		}
		park(t, b, msg{key: "k", seq: 2}) // k-02's letter replayed alone: stays in its place
		tx = begin(t, b)
		ps, err := b.store.Release(ctx, tx, consumidor, "k", "k-00") // the head's replay succeeded
		must(t, err)
		applyAll(t, b, tx, ps)
		must(t, tx.Commit(ctx))
		var ids []string
		for _, p := range ps {
			ids = append(ids, p.ID)
		}
		if !slices.Equal(ids, []string{"k-01", "k-02", "k-03"}) {
			t.Fatalf("replaying the head released %v, want [k-01 k-02 k-03]", ids)
		}
	}
}

// TestOtherKeysNeverWaitAndOneKeySerialises: while a transaction holds key
// A's row (a Release in flight, not committed), another transaction checks
// A and B, parks behind B and blocks C without waiting; a Park on A waits
// for the Release (seen waiting in pg_locks) and then finds A unblocked.
func TestOtherKeysNeverWaitAndOneKeySerialises(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, keyorder.Config{})
	block(t, b, "A", "A-00")
	block(t, b, "B", "B-00")
	park(t, b, msg{key: "A", seq: 1})
	holder := begin(t, b)
	if _, err := b.store.Release(ctx, holder, consumidor, "A", "A-00"); err != nil {
		t.Fatal(err)
	}
	// Deadline only to turn a wait into a failure instead of a hang.
	dctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	must(t, pgx.BeginFunc(dctx, b.pool, func(tx pgx.Tx) error {
		heads, err := b.store.IsBlocked(dctx, tx, consumidor, "A", "B", "C")
		if err != nil {
			return err
		}
		if len(heads) != 2 { // A's release is not committed: still blocked to others
			return fmt.Errorf("blocked %v, want A and B", heads)
		}
		if _, _, err := b.store.Park(dctx, tx, consumidor, "B", msg{key: "B", seq: 1}.parked()); err != nil {
			return err
		}
		return b.store.MarkHeadBlocked(dctx, tx, consumidor, "C", keyorder.Head{MessageID: "C-00", Reason: keyorder.ReasonRetry})
	}))
	var pid int
	waiter := make(chan error, 1)
	conn, err := b.pool.Acquire(ctx)
	must(t, err)
	defer conn.Release()
	must(t, conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	go func() {
		waiter <- pgx.BeginFunc(dctx, conn, func(tx pgx.Tx) error {
			_, _, err := b.store.Park(dctx, tx, consumidor, "A", msg{key: "A", seq: 2}.parked())
			return err
		})
	}()
	for {
		var waiting bool
		must(t, b.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)`, pid).Scan(&waiting))
		if waiting {
			break
		}
		select {
		case err := <-waiter:
			t.Fatalf("Park on A returned (%v) while A's Release was in flight: it did not wait", err)
		case <-dctx.Done():
			t.Fatal("Park on A never waited")
		case <-time.After(10 * time.Millisecond): // poll interval
		}
	}
	must(t, holder.Commit(ctx))
	if err := <-waiter; !errors.Is(err, keyorder.ErrNotBlocked) {
		t.Fatalf("Park on A after the Release committed: %v, want ErrNotBlocked", err)
	}
}

// TestBadInputIsRefusedAndChangesNothing.
func TestBadInputIsRefusedAndChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, keyorder.Config{})
	block(t, b, "k", "k-00")
	tx := begin(t, b)
	for _, m := range []keyorder.Message{
		{ID: "", Topic: "t"},
		{ID: "a\x00", Topic: "t"},
		{ID: "b", Topic: ""},
		{ID: "c", Topic: "t", Headers: []keyorder.Header{{Key: "x", Value: "\xff"}}},
	} {
		if _, _, err := b.store.Park(ctx, tx, consumidor, "k", m); !errors.Is(err, keyorder.ErrInput) {
			t.Errorf("park %+v: %v, want ErrInput", m, err)
		}
	}
	if err := b.store.MarkHeadBlocked(ctx, tx, consumidor, "", keyorder.Head{MessageID: "x", Reason: keyorder.ReasonRetry}); !errors.Is(err, keyorder.ErrInput) {
		t.Errorf("empty key: %v", err)
	}
	if err := b.store.MarkHeadBlocked(ctx, tx, consumidor, "k", keyorder.Head{MessageID: "x", Reason: "altre"}); !errors.Is(err, keyorder.ErrInput) {
		t.Errorf("unknown reason: %v", err)
	}
	if _, err := keyorder.New(keyorder.Config{Behind: 7}); err == nil {
		t.Error("unknown policy accepted")
	}
	must(t, tx.Commit(ctx))
	if n := count(t, b, `SELECT count(*) FROM missatges_aparcats`); n != 0 {
		t.Errorf("%d parked, want 0", n)
	}
}
