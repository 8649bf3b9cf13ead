package system_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
)

// --relay cdc on the machine's server (wal_level = replica) fails Start with
// the setting named, instead of a relay restarting for ever; an unknown mode
// is refused before anything starts.
func TestStartWithCDCRelaysRefusesAServerWithoutLogicalWAL(t *testing.T) {
	t.Parallel()
	_, err := system.Start(context.Background(), system.Config{Brokers: []string{"127.0.0.1:1"},
		DatabaseURL: "postgres://127.0.0.1:1/x", RelayMode: "wal"})
	if err == nil || !strings.Contains(err.Error(), "RelayMode") {
		t.Fatalf("Start with RelayMode wal: %v", err)
	}
	_, err = startWithErr(t, pgtest.URL(), []string{comandes.Name}, func(c *system.Config) { c.RelayMode = system.RelayCDC })
	if err == nil || !strings.Contains(err.Error(), "wal_level = logical") {
		t.Fatalf("Start with CDC relays on a replica-level server: %v", err)
	}
}

// km0 serve comandes --relay cdc on a logical server: the service's relay
// streams its outbox under the slot named after its database, and RelayLag
// reads it as for the polling relay.
func TestServeWithACDCRelayPublishesTheOutbox(t *testing.T) {
	t.Parallel()
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatalf("a private PostgreSQL cluster is required: %v", err)
	}
	t.Cleanup(c.Stop)
	sys, err := startWithErr(t, c.URL, []string{comandes.Name}, func(c *system.Config) { c.RelayMode = system.RelayCDC })
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pool := sys.Pool(comandes.Name)
	ob := outbox.New(outbox.Config{})
	e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-2026-000001", Type: "comanda.creada", Payload: map[string]any{"id": "P-2026-000001"}}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, e) }); err != nil {
		t.Fatal(err)
	}
	testkit.Eventuallyf(t, 30*time.Second, "no row pending in the relay's lag", func() (bool, string) {
		lag, err := sys.RelayLag(ctx)
		return err == nil && len(lag) == 1 && lag[comandes.Name].Pending == 0, fmt.Sprintf("relay lag %v (%v)", lag, err)
	})
	var slot string
	if err := pool.QueryRow(ctx, "SELECT slot_name FROM pg_replication_slots WHERE active").Scan(&slot); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(slot, "km0_comandes_") || !strings.HasSuffix(slot, "_outbox") {
		t.Fatalf("slot %q, want km0_comandes_<suffix>_outbox", slot)
	}
}

// startWithErr starts services on their own embedded broker and fresh
// databases of the server at url, returning Start's error.
func startWithErr(t *testing.T, url string, services []string, tweak func(*system.Config)) (*system.System, error) {
	t.Helper()
	b := kafkatest.New(t, system.DomainTopics()...)
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	cfg := system.Config{DatabaseURL: url, DatabaseSuffix: "tcdc" + hex.EncodeToString(suffix), Brokers: b.Addrs(), Services: services, SigningKey: testKey}
	tweak(&cfg)
	t.Cleanup(func() { // after Close; a private cluster goes whole
		if url == pgtest.URL() {
			for _, service := range services {
				_ = svc.DropDatabase(context.Background(), url, svc.DatabaseName(service, cfg.DatabaseSuffix))
			}
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	sys, err := system.Start(ctx, cfg)
	if err != nil {
		cancel()
		return nil, err
	}
	t.Cleanup(func() {
		sys.Close()
		cancel()
	})
	return sys, nil
}

// km0 serve comandes --outbox wal on a logical server: the service's slot
// exists as soon as Start returns (before anything may be written), the
// service's outbox writes WAL messages, its relay streams them (the slot
// moves past them) and the outbox table stays empty. A polling relay or
// pruning with the WAL mode fails Start.
func TestServeWithAWALModeOutboxPublishesIt(t *testing.T) {
	t.Parallel()
	for _, bad := range []func(*system.Config){
		func(c *system.Config) { c.OutboxMode, c.RelayMode = outbox.ModeWAL, system.RelayPolling },
		func(c *system.Config) { c.OutboxMode, c.RelayDeletePublished = outbox.ModeWAL, true },
		func(c *system.Config) { c.OutboxMode = "rows" },
	} {
		cfg := system.Config{Brokers: []string{"127.0.0.1:1"}, DatabaseURL: "postgres://127.0.0.1:1/x"}
		bad(&cfg)
		if _, err := system.Start(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "OutboxMode") {
			t.Errorf("Start with OutboxMode %q, RelayMode %q: %v, want an error naming OutboxMode", cfg.OutboxMode, cfg.RelayMode, err)
		}
	}
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatalf("a private PostgreSQL cluster is required: %v", err)
	}
	t.Cleanup(c.Stop)
	sys, err := startWithErr(t, c.URL, []string{comandes.Name}, func(c *system.Config) { c.OutboxMode = outbox.ModeWAL })
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pool := sys.Pool(comandes.Name)
	var db string
	if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	slot := migrate.WALSlot(db, migrate.Names{})
	var slots int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&slots); err != nil || slots != 1 {
		t.Fatalf("slot %s: %d (%v), want it there once Start returned", slot, slots, err)
	}
	ob := outbox.New(outbox.Config{Mode: outbox.ModeWAL})
	e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-2026-000001", Type: "comanda.creada", Payload: map[string]any{"id": "P-2026-000001"}}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, e) }); err != nil {
		t.Fatal(err)
	}
	var end, confirmed int64
	if err := pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8").Scan(&end); err != nil {
		t.Fatal(err)
	}
	testkit.Eventuallyf(t, 30*time.Second, fmt.Sprintf("slot %s to confirm %d", slot, end), func() (bool, string) {
		if err := pool.QueryRow(ctx, "SELECT coalesce(pg_wal_lsn_diff(confirmed_flush_lsn, '0/0'), 0)::int8 FROM pg_replication_slots WHERE slot_name = $1",
			slot).Scan(&confirmed); err != nil {
			t.Fatal(err)
		}
		return confirmed >= end, fmt.Sprintf("confirmed %d", confirmed)
	})
	var rows int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("outbox rows %d (%v), want 0", rows, err)
	}
}
