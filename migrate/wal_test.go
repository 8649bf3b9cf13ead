package migrate_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
)

// Slot names: valid names pass as they are; names that do not fit are
// lower-cased, cut and hashed, and two different sets of names never
// share one; the WAL slot names the database, and the prefix the outbox.
func TestSlotNamesAndPrefix(t *testing.T) {
	t.Parallel()
	if got := migrate.WALSlot("botiga", migrate.Names{}); got != "km0_wal_botiga_public_outbox" {
		t.Fatalf("WALSlot %q", got)
	}
	if got := migrate.WALPrefix(migrate.Names{Schema: "vendes"}); got != "km0.outbox:vendes.outbox" {
		t.Fatalf("WALPrefix %q", got)
	}
	odd := migrate.SlotName("km0", "Botiga-Nord", strings.Repeat("x", 80))
	if len(odd) > 63 || strings.ToLower(odd) != odd || strings.ContainsAny(odd, "-") {
		t.Fatalf("SlotName of odd names %q is not a slot name", odd)
	}
	if migrate.SlotName("km0", "a-b", "c") == migrate.SlotName("km0", "a_b", "c") {
		t.Fatal("two sets of names share a slot")
	}
}

// On a server without wal_level = logical (the machine's shared one),
// EnsureWALSlot refuses with the setting and its fix named, and creates
// nothing (no publication either); a bad slot name is refused before any
// query.
func TestEnsureWALSlotRefusesWithoutLogicalWALAndCreatesNothing(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	slot := migrate.WALSlot("x", s.Names()) + "_t"
	created, err := migrate.EnsureWALSlot(ctx, s.Pool, slot, "")
	if created || !errors.Is(err, migrate.ErrSlot) || !strings.Contains(err.Error(), "wal_level = logical") {
		t.Fatalf("EnsureWALSlot on a replica-level server: %v, %v", created, err)
	}
	var pubs int
	if err := s.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_publication WHERE pubname = $1", slot).Scan(&pubs); err != nil || pubs != 0 {
		t.Fatalf("publications %d (%v), want 0", pubs, err)
	}
	if _, err := migrate.EnsureWALSlot(ctx, s.Pool, "Bad-Slot", ""); !errors.Is(err, migrate.ErrSlot) || !strings.Contains(err.Error(), "not a slot name") {
		t.Fatalf("bad slot name: %v", err)
	}
}
