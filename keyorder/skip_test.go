package keyorder_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/keyorder"
)

func deadHead(t *testing.T, b *bundle, key, head string) {
	t.Helper()
	must(t, pgx.BeginFunc(context.Background(), b.pool, func(tx pgx.Tx) error {
		return b.store.MarkHeadBlocked(context.Background(), tx, consumidor, key, keyorder.Head{MessageID: head, Reason: keyorder.ReasonDeadLettered})
	}))
}

func skip(t *testing.T, b *bundle, key, head, letter string) (keyorder.Parked, bool, error) {
	t.Helper()
	var (
		p  keyorder.Parked
		ok bool
	)
	err := pgx.BeginFunc(context.Background(), b.pool, func(tx pgx.Tx) error {
		var err error
		p, ok, err = b.store.Skip(context.Background(), tx, consumidor, key, head, letter)
		return err
	})
	return p, ok, err
}

// TestSkipMakesTheNextParkedMessageTheHead: a dead-lettered head k-00 with
// k-01 and k-02 behind it is skipped: k-01 becomes the head (dead-lettered,
// with its letter, its row kept), so its replay applies it and releases
// k-02; k-00 is neither the head nor parked any more. A head that waits for
// a retry cannot be skipped; a stale head is ErrNotHead. A skipped head with
// nothing behind it unblocks its key, and a head that is a released message
// still stored loses its stored row.
func TestSkipMakesTheNextParkedMessageTheHead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, keyorder.Config{})

	block(t, b, "k", "k-00")
	if _, _, err := skip(t, b, "k", "k-00", ""); !errors.Is(err, keyorder.ErrNotDeadLettered) {
		t.Fatalf("skip of a head waiting for a retry: %v, want ErrNotDeadLettered", err)
	}
	deadHead(t, b, "k", "k-00")
	park(t, b, msg{key: "k", seq: 1})
	park(t, b, msg{key: "k", seq: 2})
	next, ok, err := skip(t, b, "k", "k-00", "dlq/0/7")
	must(t, err)
	if !ok || next.ID != "k-01" {
		t.Fatalf("skip: next %+v ok %v, want k-01", next, ok)
	}
	seq, ok, err := b.store.Sequence(ctx, b.pool, consumidor, "k")
	must(t, err)
	if !ok || seq.Head.MessageID != "k-01" || seq.Head.Reason != keyorder.ReasonDeadLettered || seq.Head.LetterID != "dlq/0/7" ||
		len(seq.Behind) != 2 || seq.Behind[0].ID != "k-01" || seq.Behind[1].ID != "k-02" {
		t.Fatalf("sequence after the skip: %+v", seq)
	}
	if _, _, err := skip(t, b, "k", "k-00", ""); !errors.Is(err, keyorder.ErrNotHead) {
		t.Fatalf("second skip of k-00: %v, want ErrNotHead", err)
	}
	// The replay of k-01: the consumer applies it, then releases the rest.
	var got []string
	must(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		cur := "k-01"
		for {
			p, more, err := b.store.ReleaseNext(ctx, tx, consumidor, "k", cur)
			if err != nil || !more {
				return err
			}
			if p.ID != cur {
				got = append(got, p.ID)
			}
			cur = p.ID
		}
	}))
	if len(got) != 1 || got[0] != "k-02" {
		t.Fatalf("released after k-01: %v, want k-02", got)
	}
	if n := count(t, b, `SELECT count(*) FROM claus_bloquejades`) + count(t, b, `SELECT count(*) FROM missatges_aparcats`); n != 0 {
		t.Fatalf("%d row(s) left, want the key released", n)
	}

	// Nothing behind: the key is unblocked.
	deadHead(t, b, "j", "j-00")
	if _, ok, err := skip(t, b, "j", "j-00", ""); err != nil || ok {
		t.Fatalf("skip with nothing behind: ok %v %v", ok, err)
	}
	if _, ok, err := b.store.Sequence(ctx, b.pool, consumidor, "j"); err != nil || ok {
		t.Fatalf("key j after the skip: blocked %v %v", ok, err)
	}

	// The head is a released message that failed, its row still stored.
	deadHead(t, b, "m", "m-00")
	park(t, b, msg{key: "m", seq: 1})
	park(t, b, msg{key: "m", seq: 2})
	deadHead(t, b, "m", "m-01")
	next, ok, err = skip(t, b, "m", "m-01", "")
	must(t, err)
	if !ok || next.ID != "m-02" {
		t.Fatalf("skip of a stored head: next %+v ok %v, want m-02", next, ok)
	}
	seq, _, err = b.store.Sequence(ctx, b.pool, consumidor, "m")
	must(t, err)
	if seq.Head.MessageID != "m-02" || len(seq.Behind) != 1 || seq.Behind[0].ID != "m-02" {
		t.Fatalf("sequence after skipping a stored head: %+v, want m-02 alone", seq)
	}
}
