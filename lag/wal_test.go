package lag_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
)

// A WAL-mode outbox has no rows to count: what is pending is its slot's
// lag. Before anything is written the slot has no lag and the age is known
// (0); after two events written with no relay streaming, the Measurer
// reports the bytes not confirmed and the age of the oldest event, read
// from the slot without consuming it (the second measure sees the same).
// A WAL outbox whose slot is missing is an error naming it. On a cluster of
// its own: the shared server runs wal_level = replica.
func TestMeasureWALOutbox(t *testing.T) {
	t.Parallel()
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatalf("a private PostgreSQL cluster is required: %v", err)
	}
	t.Cleanup(c.Stop)
	ctx := context.Background()
	pool := pgtest.NewPool(t, c.URL, 4)
	names := migrate.Names{}.WithDefaults()
	if _, err := migrate.Up(ctx, pool, names, migrate.Outbox); err != nil {
		t.Fatal(err)
	}
	slot := migrate.WALSlot("postgres", names)
	if _, err := migrate.EnsureWALSlot(ctx, pool, slot, ""); err != nil {
		t.Fatal(err)
	}
	now := time.Now().Add(time.Hour)
	m, err := lag.NewMeasurer(lag.Config{Outboxes: []lag.Outbox{{Name: "comandes", DB: pool, WAL: true},
		{Name: "absent", DB: pool, WAL: true, Slot: "km0_wal_absent"}}, Logger: quiet, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	measure := func() (lag.OutboxLag, lag.OutboxLag, []string) {
		t.Helper()
		s, err := m.Measure(ctx)
		if err != nil || len(s.Outboxes) != 2 {
			t.Fatalf("measure: %v %+v", err, s)
		}
		return s.Outboxes[0], s.Outboxes[1], s.Errors
	}
	o, absent, errs := measure()
	if o.Err != "" || o.WAL == nil || o.WAL.Slot != slot || o.WAL.LagBytes != 0 || !o.WAL.OldestKnown || o.OldestSeconds != 0 || o.WAL.Active {
		t.Fatalf("before any write: %+v %+v", o, o.WAL)
	}
	if absent.WAL != nil || absent.Err != "its replication slot km0_wal_absent does not exist (km0 migrate --outbox-mode wal creates it)" ||
		len(errs) != 1 || errs[0] != "outbox absent: "+absent.Err {
		t.Fatalf("missing slot: %+v, errors %q", absent, errs)
	}

	ob := outbox.New(outbox.Config{Mode: outbox.ModeWAL})
	before := time.Now()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return ob.EnqueueBatch(ctx, tx, []*outbox.Event{
			{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: map[string]any{"id": "P-1"}},
			{Aggregate: "comanda", AggregateID: "P-2", Type: "comanda.creada", Payload: map[string]any{"id": "P-2"}},
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	for range 2 {
		o, _, _ = measure()
		lo, hi := now.Sub(after).Seconds()-1, now.Sub(before).Seconds()+1 // the server's clock is this machine's
		if o.Err != "" || o.WAL == nil || o.WAL.LagBytes <= 0 || o.WAL.RetainedBytes < o.WAL.LagBytes || o.WAL.WALStatus != "reserved" ||
			!o.WAL.OldestKnown || o.OldestSeconds < lo || o.OldestSeconds > hi {
			t.Fatalf("after two events: %+v %+v; want lag bytes and an age in [%.0f, %.0f] s", o, o.WAL, lo, hi)
		}
	}
}
