package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/pgtest"
)

func setup(t *testing.T) (*pgtest.Schema, *inbox.Inbox) {
	t.Helper()
	s := pgtest.NewMigratedSchema(t)
	if _, err := s.Pool.Exec(context.Background(), "CREATE TABLE efectes (n INTEGER NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return s, inbox.New(inbox.Config{Names: s.Names()})
}

func effect(tx pgx.Tx) error {
	_, err := tx.Exec(context.Background(), "INSERT INTO efectes VALUES (1)")
	return err
}

func TestProcessRunsTheEffectOncePerKeyAndConsumer(t *testing.T) {
	t.Parallel()
	s, ib := setup(t)
	ctx := context.Background()
	for i, want := range []inbox.Result{inbox.Processed, inbox.Duplicate, inbox.Duplicate} {
		res, err := ib.Process(ctx, s.Pool, "inventari.descompte_estoc", "m-1", effect)
		if err != nil || res != want {
			t.Fatalf("call %d: %v %v, want %v", i, res, err, want)
		}
	}
	// Another piece of logic processes the same message once too.
	if res, err := ib.Process(ctx, s.Pool, "inventari.avis_productor", "m-1", effect); err != nil || res != inbox.Processed {
		t.Fatalf("second consumer: %v %v", res, err)
	}
	if n := count(t, s, "SELECT count(*) FROM efectes"); n != 2 {
		t.Fatalf("effects %d, want 2", n)
	}
}

func TestFailedEffectRollsBackTheKeyToo(t *testing.T) {
	t.Parallel()
	s, ib := setup(t)
	ctx := context.Background()
	boom := errors.New("estoc insuficient")
	_, err := ib.Process(ctx, s.Pool, "c", "m-2", func(tx pgx.Tx) error {
		if err := effect(tx); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("error not returned as is: %v", err)
	}
	if k, e := count(t, s, "SELECT count(*) FROM missatges_processats"), count(t, s, "SELECT count(*) FROM efectes"); k != 0 || e != 0 {
		t.Fatalf("after a failed effect: %d keys, %d effects; want 0, 0", k, e)
	}
	if res, err := ib.Process(ctx, s.Pool, "c", "m-2", effect); err != nil || res != inbox.Processed {
		t.Fatalf("retry after failure: %v %v", res, err)
	}
}

func TestPurgeDeletesKeysOlderThanRetention(t *testing.T) {
	t.Parallel()
	s, ib := setup(t)
	ctx := context.Background()
	if _, err := s.Pool.Exec(ctx, `INSERT INTO missatges_processats (id_missatge, consumidor, processat_en)
		VALUES ('vell', 'c', now() - interval '15 days'), ('nou', 'c', now() - interval '13 days')`); err != nil {
		t.Fatal(err)
	}
	n, err := ib.Purge(ctx, s.Pool)
	if err != nil || n != 1 {
		t.Fatalf("purged %d (%v), want 1", n, err)
	}
	if n, _ := ib.PurgeOlderThan(ctx, s.Pool, time.Hour); n != 1 {
		t.Fatalf("purge older than 1h deleted %d, want 1", n)
	}
}

func count(t *testing.T, s *pgtest.Schema, q string) int {
	t.Helper()
	var n int
	if err := s.Pool.QueryRow(context.Background(), q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
