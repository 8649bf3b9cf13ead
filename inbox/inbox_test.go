package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
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
	if _, err := s.Pool.Exec(ctx, `INSERT INTO missatges_processats (id_missatge, consumidor) VALUES ('ara', 'c')`); err != nil {
		t.Fatal(err)
	}
	before := count(t, s, "SELECT count(*) FROM missatges_processats")
	for _, age := range []time.Duration{0, -time.Hour} {
		if n, err := ib.PurgeOlderThan(ctx, s.Pool, age); err == nil || n != 0 {
			t.Fatalf("purge older than %v: %d deleted, err %v; want a refusal", age, n, err)
		}
	}
	if after := count(t, s, "SELECT count(*) FROM missatges_processats"); after != before || before == 0 {
		t.Fatalf("keys %d before, %d after a refused purge", before, after)
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

// Two deliveries of one message in parallel transactions: the second waits on
// the first's key and, when it commits, is a duplicate; when it rolls back,
// the second runs the effect. One effect either way (guarantee 2).
func TestParallelDeliveriesOfOneMessageApplyTheEffectOnce(t *testing.T) {
	t.Parallel()
	for _, firstFails := range []bool{false, true} {
		s, ib := setup(t)
		ctx := context.Background()
		inEffect, release := make(chan struct{}), make(chan struct{})
		first := make(chan error, 1)
		go func() {
			_, err := ib.Process(ctx, s.Pool, "c", "m-par", func(tx pgx.Tx) error {
				if err := effect(tx); err != nil {
					return err
				}
				close(inEffect)
				<-release
				if firstFails {
					return errors.New("estoc insuficient")
				}
				return nil
			})
			first <- err
		}()
		<-inEffect
		second := make(chan inbox.Result, 1)
		go func() {
			res, err := ib.Process(ctx, s.Pool, "c", "m-par", effect)
			if err != nil {
				t.Error(err)
			}
			second <- res
		}()
		// The second is blocked on the first's uncommitted key.
		// pg_locks is the whole server's: count only a wait on this test's table.
		testkit.Eventually(t, 10*time.Second, "the second delivery to wait for the first", func() bool {
			var n int
			if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
				WHERE NOT l.granted AND l.locktype = 'transactionid' AND strpos(a.query, $1) > 0`, s.Name).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n > 0
		})
		close(release)
		err1 := <-first
		res2 := <-second
		want := inbox.Duplicate
		if firstFails {
			want = inbox.Processed
		}
		if (err1 != nil) != firstFails || res2 != want {
			t.Fatalf("first fails %v: first %v, second %v; want second %v", firstFails, err1, res2, want)
		}
		if k, e := count(t, s, "SELECT count(*) FROM missatges_processats"), count(t, s, "SELECT count(*) FROM efectes"); k != 1 || e != 1 {
			t.Fatalf("first fails %v: %d keys, %d effects; want 1, 1", firstFails, k, e)
		}
	}
}

// A database outage in the middle of the effect (here the effect's own
// backend is terminated) is ErrStore, like one at BEGIN or COMMIT: the
// message is retried in place and no attempt is spent. Before, it came back
// as the effect's error, and a message on its last attempt went to the DLQ.
// A failure of the effect that leaves the connection alive stays the effect's.
func TestConnectionLostDuringTheEffectIsErrStore(t *testing.T) {
	t.Parallel()
	s, ib := setup(t)
	ctx := context.Background()
	_, err := ib.Process(ctx, s.Pool, "c", "m-9", func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
		return err
	})
	if !errors.Is(err, inbox.ErrStore) {
		t.Fatalf("got %v, want ErrStore", err)
	}
	_, err = ib.Process(ctx, s.Pool, "c", "m-9", func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SELECT 1/0")
		return err
	})
	if err == nil || errors.Is(err, inbox.ErrStore) {
		t.Fatalf("division by zero: got %v, want the effect's own error", err)
	}
	if res, err := ib.Process(ctx, s.Pool, "c", "m-9", effect); err != nil || res != inbox.Processed {
		t.Fatalf("retry: %v %v", res, err)
	}
	if k, e := count(t, s, "SELECT count(*) FROM missatges_processats"), count(t, s, "SELECT count(*) FROM efectes"); k != 1 || e != 1 {
		t.Fatalf("%d keys, %d effects; want 1, 1", k, e)
	}
}

func TestCheckConsumerRefusesNamesTheKeyTableCannotStore(t *testing.T) {
	t.Parallel()
	if err := inbox.CheckConsumer("inventari.descompte_estoc"); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"", "a\x00b", "\xff\xfe", string(make([]byte, 257))} {
		if inbox.CheckConsumer(bad) == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
