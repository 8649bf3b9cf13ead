package cdc_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport/kafka"
)

// migratedDatabase is a new database on the cluster with the contract's
// public.outbox; its slots are dropped at cleanup, before the database.
func migratedDatabase(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	u := pgtest.NewDatabase(t)
	pool := pgtest.NewPool(t, u, 4)
	t.Cleanup(func() {
		testkit.Eventually(t, 10*time.Second, "the database's slots dropped", func() bool {
			_, err := pool.Exec(context.Background(), "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database()")
			return err == nil
		})

	})
	if _, err := migrate.Up(context.Background(), pool, migrate.Names{}, migrate.Outbox); err != nil {
		t.Fatal(err)
	}
	var db string
	if err := pool.QueryRow(context.Background(), "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	return pool, db
}

// Slots are server-wide: two databases of one server with the same
// public.outbox get two default slots (named after the database), both
// relays stream; a relay given the other database's slot is refused with an
// error that says whose slot it is and never suggests dropping it; and a
// slot of the old default name (km0_public_outbox) in the relay's own
// database is not left behind for a new one: the relay refuses, naming
// --slot.
func TestDefaultSlotsAreNamedAfterTheDatabaseAndForeignSlotsAreNotOffered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	poolA, dbA := migratedDatabase(t)
	poolB, dbB := migratedDatabase(t)
	b := kafkatest.New(t, topic)
	pub := kafka.NewPublisher(kafkatest.Client(t, b))
	cfg := func(pool *pgxpool.Pool, app string) cdc.Config {
		return cdc.Config{Config: relay.Config{Pool: pool, Publisher: pub, Topic: topic, Origin: "comandes",
			BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond, ApplicationName: app, Logger: testLogger()},
			StatusInterval: 100 * time.Millisecond}
	}
	ra, rb := newRelay(t, cfg(poolA, "km0-a")), newRelay(t, cfg(poolB, "km0-b"))
	if ra.Slot() == rb.Slot() || ra.Slot() != cdc.DefaultSlotIn(dbA, migrate.Names{}) || !strings.Contains(rb.Slot(), dbB) {
		t.Fatalf("slots %q and %q, want one per database, named after it", ra.Slot(), rb.Slot())
	}
	start(t, ra)
	start(t, rb)
	ob := outbox.New(outbox.Config{})
	for _, w := range []struct {
		pool *pgxpool.Pool
		agg  string
	}{{poolA, "A"}, {poolB, "B"}} {
		if err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
			return ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: w.agg, Type: "comanda.creada", Payload: relaytest.SeqPayload{Seq: 1}})
		}); err != nil {
			t.Fatal(err)
		}
	}
	perKey, _ := relaytest.FirstSeqs(t, relaytest.Read(t, b, topic, 2))
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"A": 1, "B": 1})

	poolC, dbC := migratedDatabase(t)
	foreign := cfg(poolC, "km0-c")
	foreign.Slot = ra.Slot()
	err := runUntilError(t, newRelay(t, foreign), 20*time.Second)
	if !errors.Is(err, cdc.ErrSetup) || !strings.Contains(err.Error(), dbA) || !strings.Contains(err.Error(), dbC) ||
		strings.Contains(err.Error(), "drop") {
		t.Fatalf("relay of %s given %s's slot: %v; want ErrSetup naming both databases, suggesting no drop", dbC, dbA, err)
	}
	if _, err := poolC.Exec(ctx, "SELECT pg_create_logical_replication_slot('km0_public_outbox', 'pgoutput')"); err != nil {
		t.Fatal(err)
	}
	err = runUntilError(t, newRelay(t, cfg(poolC, "km0-c")), 20*time.Second)
	if !errors.Is(err, cdc.ErrSetup) || !strings.Contains(err.Error(), "--slot km0_public_outbox") {
		t.Fatalf("relay beside a slot of the old default name: %v; want ErrSetup naming --slot km0_public_outbox", err)
	}
	if n := countSlots(t, poolC); n != 1 {
		t.Fatalf("%d slots in %s, want only the old one (no new slot left beside it)", n, dbC)
	}
}

func countSlots(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A restart logs the position it resumes from, the slot's
// confirmed_flush_lsn, not 0/0 (the "from where the slot is" of
// START_REPLICATION).
func TestRestartLogsTheResumePosition(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stop := start(t, newRelay(t, b.config()))
	b.enqueue(t, "A", relaytest.SeqPayload{Seq: 1})
	testkit.Eventually(t, 10*time.Second, "the row published and its position confirmed", func() bool {
		return b.pending(t) == 0 && b.confirmedLSN(t) > 0
	})

	if err := stop(); err != nil {
		t.Fatal(err)
	}
	// The walsender applies the relay's last status update as it reads it,
	// which can be after the relay has closed its end: read the position
	// once the slot is released.
	var resume string
	testkit.Eventually(t, 10*time.Second, "the slot released by the stopped relay", func() bool {
		var active bool
		if err := b.s.Pool.QueryRow(context.Background(), "SELECT active, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", b.slot()).Scan(&active, &resume); err != nil {
			t.Fatal(err)
		}
		return !active
	})

	var logs testlog.Buffer
	cfg := b.config()
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	r := newRelay(t, cfg)
	start(t, r)
	line := ""
	testkit.Eventually(t, 10*time.Second, "the restarted relay to log that it holds the slot", func() bool {
		for _, l := range strings.Split(logs.String(), "\n") {
			if strings.Contains(l, "holding the slot") {
				line = l
			}
		}
		return line != ""
	})

	if !strings.Contains(line, "start="+resume+" ") {
		t.Fatalf("restart log %q, want start=%s (the slot's confirmed_flush_lsn)", line, resume)
	}
}
