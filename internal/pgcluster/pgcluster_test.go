package pgcluster_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgcluster"
)

// A private cluster starts with wal_level=logical, answers on its own port,
// and is gone after Stop.
func TestStartClusterIsLogicalAndStops(t *testing.T) {
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	var level string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	if level != "logical" {
		t.Fatalf("wal_level = %q, want logical", level)
	}
	c.Stop()
	if conn, err := pgx.Connect(ctx, c.URL); err == nil {
		conn.Close(ctx)
		t.Fatal("the cluster still answers after Stop")
	}
}
