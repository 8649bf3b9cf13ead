package pgbouncer_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgbouncer"
	"github.com/km0/km0/internal/pgcluster"
)

// Through a transaction-pooling bouncer two transactions of one client
// may run on different server sessions; through a session-pooling one
// they run on the same. Many clients at once make the difference show.
func TestPoolModes(t *testing.T) {
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	for _, mode := range []string{pgbouncer.Transaction, pgbouncer.Session} {
		b, err := pgbouncer.Start(pgbouncer.Options{Upstream: "127.0.0.1:" + strconv.Itoa(c.Port), Mode: mode, PoolSize: 2})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Stop()
		ctx := context.Background()
		var conns []*pgx.Conn
		for range 2 {
			conn, err := pgx.Connect(ctx, b.URL("postgres", "default_query_exec_mode=cache_describe"))
			if err != nil {
				t.Fatal(mode, err)
			}
			defer conn.Close(ctx)
			conns = append(conns, conn)
		}
		// Client 0 opens a transaction and holds it: its server session is
		// taken. Client 1 then runs two statements.
		tx, err := conns[0].Begin(ctx)
		if err != nil {
			t.Fatal(mode, err)
		}
		var held int
		if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&held); err != nil {
			t.Fatal(mode, err)
		}
		var pid int
		if err := conns[1].QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(mode, err)
		}
		_ = tx.Rollback(ctx)
		var again int
		if err := conns[0].QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&again); err != nil {
			t.Fatal(mode, err)
		}
		t.Logf("%s: held %d, other %d, again %d", mode, held, pid, again)
		if pid == held {
			t.Fatalf("%s: two clients shared server session %d while one was in a transaction", mode, pid)
		}
	}
}
