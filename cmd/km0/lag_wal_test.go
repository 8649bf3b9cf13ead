package main

import (
	"bytes"
	"context"
	"encoding/json"
	"regexp"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
)

// km0 lag --outbox-mode wal measures a WAL-mode outbox from its slot: with
// three events written and no relay, the unconfirmed bytes, a known age,
// the default slot, and "no relay"; --json carries the same. On a cluster
// of its own (wal_level = logical).
func TestLagCommandWALOutbox(t *testing.T) {
	t.Parallel()
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatalf("a private PostgreSQL cluster is required: %v", err)
	}
	t.Cleanup(c.Stop)
	ctx := context.Background()
	pool := pgtest.NewPool(t, c.URL, 2)
	names := migrate.Names{}.WithDefaults()
	if _, err := migrate.Up(ctx, pool, names, migrate.Outbox); err != nil {
		t.Fatal(err)
	}
	slot := migrate.WALSlot("postgres", names)
	if _, err := migrate.EnsureWALSlot(ctx, pool, slot, ""); err != nil {
		t.Fatal(err)
	}
	ob := outbox.New(outbox.Config{Mode: outbox.ModeWAL})
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, id := range []string{"P-1", "P-2", "P-3"} {
			if err := ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: id, Type: "comanda.creada", Payload: map[string]any{"id": id}}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Every run names the outbox with --outbox, which replaces $KM0_OUTBOXES
	// (TestOutboxForms).
	run := func(args ...string) string {
		t.Helper()
		var out, errOut bytes.Buffer
		if err := lagCmd(ctx, &out, &errOut, append([]string{"--brokers", "", "--outbox", "comandes=" + c.URL, "--outbox-mode", "wal"}, args...)); err != nil {
			t.Fatalf("km0 lag %v: %v\n%s%s", args, err, out.String(), errOut.String())
		}
		return out.String()
	}
	out := run()
	row := regexp.MustCompile(`(?m)^comandes\s+wal\s+\d+ B\s+(\d+s|-)\s+` + regexp.QuoteMeta(slot) + `\s+\S+ \S+\s+reserved, no relay$`)
	if !row.MatchString(out) {
		t.Fatalf("km0 lag --outbox-mode wal:\n%s", out)
	}
	var snap lag.Snapshot
	if err := json.Unmarshal([]byte(run("--json")), &snap); err != nil {
		t.Fatal(err)
	}
	if len(snap.Outboxes) != 1 || snap.Outboxes[0].WAL == nil || snap.Outboxes[0].WAL.LagBytes <= 0 || !snap.Outboxes[0].WAL.OldestKnown ||
		snap.Outboxes[0].WAL.Slot != slot {
		t.Fatalf("km0 lag --outbox-mode wal --json: %+v", snap.Outboxes)
	}
	var errOut bytes.Buffer
	if err := lagCmd(ctx, &bytes.Buffer{}, &errOut, []string{"--brokers", "", "--outbox", "comandes=" + c.URL, "--slot", slot}); err == nil ||
		err.Error() != "--slot applies to --outbox-mode wal only" {
		t.Fatalf("--slot without --outbox-mode wal: %v", err)
	}
}
