package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay/cdc"
)

// --mode and the flags of each mode are checked before anything connects.
func TestRelayCommandRefusesBadModeFlags(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--mode", "wal"}, `--mode "wal"`},
		{[]string{"--slot", "s"}, "--mode cdc only"},
		{[]string{"--mode", "cdc", "--workers", "2"}, "--mode polling only"},
		{[]string{"--mode", "cdc", "--slot", "Bad-Name"}, "slot name"},
		{[]string{"--mode", "cdc", "--poll", "1s"}, "--poll applies to --mode polling only"},
		{[]string{"--outbox", "wal", "--mode", "polling"}, "--outbox wal is streamed by --mode cdc only"},
		{[]string{"--outbox", "wal", "--delete-published"}, "--delete-published applies to --outbox table only"},
		{[]string{"--outbox", "wal", "--prune-older-than", "1h"}, "--prune-older-than applies to --outbox table only"},
		{[]string{"--outbox", "rows"}, `--outbox "rows"`},
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
	t.Parallel()
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
	t.Parallel()
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
	var db string
	if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	slotName := cdc.DefaultSlotIn(db, names)
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
	written := false
	testkit.Eventuallyf(t, 30*time.Second, "P-2 written once the slot is active, and no row pending", func() (bool, string) {
		if !written {
			var slot bool
			if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active)", slotName).Scan(&slot); err != nil {
				t.Fatal(err)
			}
			if slot {
				write("P-2") // streamed
				written = true
			}
		}
		n := pending()
		return written && n == 0, fmt.Sprintf("written %v, %d rows pending", written, n)
	})
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

// `km0 migrate --outbox-mode wal` creates the WAL-mode outbox's publication
// and slot (once: a second run finds them), after which writes in WAL mode
// pass, and `km0 relay --outbox wal` (--mode cdc implied) publishes them in
// order, with no outbox row written.
func TestMigrateAndRelayCommandsRunAWALModeOutbox(t *testing.T) {
	t.Parallel()
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
	ob := outbox.New(outbox.Config{Mode: outbox.ModeWAL, SlotCheckInterval: time.Millisecond})
	write := func(agg string, seq int) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: agg, Type: "comanda.creada", Payload: map[string]int{"seq": seq}})
		})
	}
	if err := runMigrate(ctx, []string{"--database-url", c.URL}); err != nil {
		t.Fatal(err)
	}
	if err := write("P-1", 1); !errors.Is(err, outbox.ErrNoSlot) {
		t.Fatalf("a WAL-mode write after km0 migrate without --outbox-mode wal: %v, want ErrNoSlot", err)
	}
	for range 2 {
		if err := runMigrate(ctx, []string{"--database-url", c.URL, "--outbox-mode", "wal"}); err != nil {
			t.Fatal(err)
		}
	}
	var db string
	if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	var slots int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", migrate.WALSlot(db, migrate.Names{})).Scan(&slots); err != nil || slots != 1 {
		t.Fatalf("slots %d (%v), want 1", slots, err)
	}
	for i := range 5 {
		if err := write("P-1", i+1); err != nil {
			t.Fatal(err)
		}
	}
	b := kafkatest.New(t, "comandes.esdeveniments")
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- runRelay(rctx, []string{"--database-url", c.URL, "--outbox", "wal", "--brokers", b.Addrs()[0],
			"--topic", "comandes.esdeveniments", "--origin", "comandes"})
	}()
	recs := kafkatest.ReadAll(t, b, "comandes.esdeveniments", 5, 20*time.Second)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("km0 relay --outbox wal: %v", err)
	}
	if len(recs) != 5 {
		t.Fatalf("%d records, want 5", len(recs))
	}
	for i, r := range recs {
		var env struct {
			Data struct{ Seq int } `json:"dades"`
		}
		if err := json.Unmarshal(r.Value, &env); err != nil || env.Data.Seq != i+1 {
			t.Fatalf("record %d: %s (%v), want seq %d", i, r.Value, err, i+1)
		}
	}
	var rows int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("outbox rows %d (%v), want 0", rows, err)
	}
}

// The start line says what each mode runs with: the CDC relay its batch
// (fixed, 2,000 by default) and no workers (it has none; --workers is
// refused), the polling relay both, adaptive by default; a WAL-mode outbox
// no pruning or deleting.
func TestRelayStartLineShowsEachModesOwnSettings(t *testing.T) {
	t.Parallel()
	attrs := func(a []any) map[string]any {
		m := map[string]any{}
		for i := 0; i+1 < len(a); i += 2 {
			m[a[i].(string)] = a[i+1]
		}
		return m
	}
	names := migrate.Names{}.WithDefaults()
	c := attrs(startAttrs(modeCDC, "table", names, "t", "o", 0, 0, 0, false))
	if _, ok := c["workers"]; ok || c["batch"] != cdc.BatchSizeDefault {
		t.Fatalf("--mode cdc start line %v: want batch %d and no workers", c, cdc.BatchSizeDefault)
	}
	p := attrs(startAttrs(modePolling, "table", names, "t", "o", 0, 0, 0, false))
	if p["batch"] != "adaptive" || p["workers"] != "adaptive" {
		t.Fatalf("polling start line %v: want batch and workers adaptive", p)
	}
	w := attrs(startAttrs(modeCDC, "wal", names, "t", "o", 500, 0, 0, false))
	if _, ok := w["delete_published"]; ok || w["batch"] != 500 || w["outbox_mode"] != "wal" {
		t.Fatalf("--outbox wal start line %v: want batch 500, outbox_mode wal, no delete_published", w)
	}
}

// `km0 relay --help` describes both modes and the WAL-mode outbox, not
// polling alone.
//
// Not parallel: it swaps os.Stderr of the whole test binary.
func TestRelayHelpDescribesEveryMode(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := os.Stderr
	os.Stderr = w
	err = runRelay(context.Background(), []string{"--help"})
	os.Stderr = stderr
	_ = w.Close()
	help, _ := io.ReadAll(r)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	for _, want := range []string{"--mode polling", "--mode cdc", "streams them from the WAL", "--outbox wal", "-outbox", "-mode"} {
		if !strings.Contains(string(help), want) {
			t.Errorf("km0 relay --help lacks %q:\n%s", want, help)
		}
	}
}

// `km0 serve --outbox wal` implies --relay cdc, and refuses --relay polling;
// on the machine's replica-level server it fails with wal_level named
// (creating the service's slot), before anything is written.
//
// Not parallel: t.Setenv, for the environment runServe ($KM0_DATABASE_URL)
// reads in this process.
func TestServeOutboxWALImpliesTheCDCRelay(t *testing.T) {
	t.Setenv("KM0_DATABASE_URL", "")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := runServe(ctx, []string{"cataleg", "--outbox", "wal", "--relay", "polling",
		"--service-database-url", "postgres://postgres@127.0.0.1:1/qualsevol", "--brokers", "127.0.0.1:1"})
	if err == nil || !strings.Contains(err.Error(), "OutboxMode") {
		t.Fatalf("km0 serve --outbox wal --relay polling: %v, want an error naming OutboxMode", err)
	}
	b := kafkatest.New(t, system.DomainTopics()...)
	err = runServe(ctx, []string{"comandes", "--outbox", "wal", "--service-database-url", pgtest.NewDatabase(t),
		"--brokers", b.Addrs()[0]})
	if err == nil || !strings.Contains(err.Error(), "wal_level = logical") {
		t.Fatalf("km0 serve comandes --outbox wal on a replica-level server: %v, want wal_level named", err)
	}
}
