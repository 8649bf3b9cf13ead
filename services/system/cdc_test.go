package system_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/services/comandes"
	"github.com/km0/km0/services/svc"
	"github.com/km0/km0/services/system"
)

// --relay cdc on the machine's server (wal_level = replica) fails Start with
// the setting named, instead of a relay restarting for ever; an unknown mode
// is refused before anything starts.
func TestStartWithCDCRelaysRefusesAServerWithoutLogicalWAL(t *testing.T) {
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
	deadline := time.Now().Add(30 * time.Second)
	for {
		lag, err := sys.RelayLag(ctx)
		if err == nil && len(lag) == 1 && lag[comandes.Name].Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay lag %v (%v) after 30s, want 0 pending", lag, err)
		}
		time.Sleep(20 * time.Millisecond) // polling with a deadline
	}
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
