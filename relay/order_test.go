package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
)

// CONTRACT 5, docs/design/outbox-relay.md I3/R4/R5, for a writer that is not
// km0 (psql, a Python service): its ids are random UUIDs, so only creat_en carries
// the order. Failure point: writer B's INSERT of aggregate X waits for X's
// lock while writer A, which holds it, writes a second row of X and commits
// first. Commit order is X1 (A), X2 (A), X3 (B); B's row must be stamped
// after A's, so it cannot be stamped before taking the lock. Besides, 20
// single-row commits of Y must go out in commit order, not by id.
func TestCommitOrderOfForeignWritersWhileOneWaitsForTheAggregate(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	const insert = `INSERT INTO outbox (id, agregat, agregat_id, tipus, carrega)
		VALUES (gen_random_uuid(), 'comanda', $1, 'comanda.creada', jsonb_build_object('seq', $2::int))`
	for i := 1; i <= 20; i++ {
		if _, err := b.s.Pool.Exec(ctx, insert, "Y", i); err != nil {
			t.Fatal(err)
		}
	}
	txA, err := b.s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer txA.Rollback(ctx) //nolint:errcheck
	if _, err := txA.Exec(ctx, insert, "X", 1); err != nil {
		t.Fatal(err)
	}
	connB, err := b.s.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer connB.Release()
	var pidB int
	if err := connB.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pidB); err != nil {
		t.Fatal(err)
	}
	doneB := make(chan error, 1)
	go func() {
		doneB <- pgx.BeginFunc(ctx, connB, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, insert, "X", 3) // commits after A: third
			return err
		})
	}()
	testkit.Eventually(t, 10*time.Second, "B's INSERT to wait for X's lock", func() bool {
		return b.count(t, "SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted", pidB) == 1
	})

	if _, err := txA.Exec(ctx, insert, "X", 2); err != nil {
		t.Fatal(err)
	}
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-doneB; err != nil {
		t.Fatal(err)
	}
	if n := b.drainOnce(t, b.newRelay(t, b.config())); n != 23 {
		t.Fatalf("published %d, want 23", n)
	}
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, 23))
	if len(copies) != 23 {
		t.Fatalf("%d distinct ids on the topic, want 23", len(copies))
	}
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"X": 3, "Y": 20})
}
