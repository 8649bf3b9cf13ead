package pgbouncer_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgbouncer"
	"github.com/km0/km0/internal/pgcluster"
)

// Start runs pgbouncer in the pool mode asked for (its admin console's SHOW
// CONFIG says so) in front of the upstream server (a query through it runs
// on that server's port).
func TestStartRunsTheModeAskedForInFrontOfTheUpstream(t *testing.T) {
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	ctx := context.Background()
	for _, mode := range []string{pgbouncer.Transaction, pgbouncer.Session} {
		b, err := pgbouncer.Start(pgbouncer.Options{Upstream: "127.0.0.1:" + strconv.Itoa(c.Port), Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Stop()
		admin, err := pgx.Connect(ctx, b.URL("pgbouncer", "default_query_exec_mode=simple_protocol"))
		if err != nil {
			t.Fatal(mode, err)
		}
		rows, err := admin.Query(ctx, "SHOW CONFIG")
		if err != nil {
			t.Fatal(mode, err)
		}
		got := ""
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				t.Fatal(mode, err)
			}
			if len(vals) > 1 && vals[0] == "pool_mode" {
				got, _ = vals[1].(string)
			}
		}
		admin.Close(ctx)
		if got != mode {
			t.Fatalf("pool_mode %q, want %q", got, mode)
		}
		conn, err := pgx.Connect(ctx, b.URL("postgres", "default_query_exec_mode=simple_protocol"))
		if err != nil {
			t.Fatal(mode, err)
		}
		var port string
		if err := conn.QueryRow(ctx, "SELECT current_setting('port')").Scan(&port); err != nil {
			t.Fatal(mode, err)
		}
		conn.Close(ctx)
		if port != strconv.Itoa(c.Port) {
			t.Fatalf("%s: the query ran on port %s, want the upstream's %d", mode, port, c.Port)
		}
	}
}
