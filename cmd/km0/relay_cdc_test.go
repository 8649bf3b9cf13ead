package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
)

// --mode and the flags of each mode are checked before anything connects.
func TestRelayCommandRefusesBadModeFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--mode", "wal"}, `--mode "wal"`},
		{[]string{"--slot", "s"}, "--mode cdc only"},
		{[]string{"--mode", "cdc", "--workers", "2"}, "--mode polling only"},
		{[]string{"--mode", "cdc", "--slot", "Bad-Name"}, "slot name"},
	} {
		err := runRelay(context.Background(), append([]string{"--database-url", "postgres://nobody@127.0.0.1:1/x",
			"--topic", "comandes.esdeveniments", "--origin", "comandes"}, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("km0 relay %v: %v, want an error with %q", c.args, err, c.want)
		}
	}
}

// The machine's server has wal_level = replica: `km0 relay --mode cdc`
// refuses at once with the setting named, before it waits for any broker.
func TestRelayCommandCDCRefusesWithoutLogicalWALLevel(t *testing.T) {
	s := pgtest.NewMigratedSchema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err := runRelay(ctx, []string{"--database-url", pgtest.URL(), "--schema", s.Name, "--mode", "cdc",
		"--brokers", "127.0.0.1:1", "--topic", "comandes.esdeveniments", "--origin", "comandes"})
	if err == nil || !strings.Contains(err.Error(), "wal_level = logical") {
		t.Fatalf("km0 relay --mode cdc on a replica-level server: %v", err)
	}
}

// `km0 relay --mode cdc` against a logical server (a private cluster)
// publishes what is pending and what is written while it runs, marks it,
// and leaves its slot and publication under the documented default names.
func TestRelayCommandCDCPublishesAndMarks(t *testing.T) {
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatalf("a private PostgreSQL cluster is required: %v", err)
	}
	t.Cleanup(c.Stop)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	names := migrate.Names{}.WithDefaults()
	if _, err := migrate.Up(ctx, pool, names, migrate.Outbox); err != nil {
		t.Fatal(err)
	}
	b := kafkatest.New(t, "comandes.esdeveniments")
	ob := outbox.New(outbox.Config{Names: names})
	write := func(agg string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: agg, Type: "comanda.creada", Payload: map[string]int{"n": 1}})
		}); err != nil {
			t.Fatal(err)
		}
	}
	write("P-1") // pending before the first start
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- runRelay(rctx, []string{"--database-url", c.URL, "--mode", "cdc", "--brokers", b.Addrs()[0],
			"--topic", "comandes.esdeveniments", "--origin", "comandes"})
	}()
	pending := func() int {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	deadline := time.Now().Add(30 * time.Second)
	for written := false; pending() != 0 || !written; {
		if time.Now().After(deadline) {
			t.Fatalf("%d rows pending after 30s", pending())
		}
		var slot bool
		if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = 'km0_public_outbox' AND active)").Scan(&slot); err != nil {
			t.Fatal(err)
		}
		if slot && !written {
			write("P-2") // streamed
			written = true
		}
		time.Sleep(10 * time.Millisecond) // polling with a deadline
	}
	if recs := kafkatest.ReadAll(t, b, "comandes.esdeveniments", 2, 10*time.Second); len(recs) != 2 {
		t.Fatalf("%d records on the topic, want 2", len(recs))
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("km0 relay --mode cdc: %v", err)
	}
	var pub bool
	if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'km0_public_outbox')").Scan(&pub); err != nil || !pub {
		t.Fatalf("publication km0_public_outbox: %v, %v", pub, err)
	}
}
