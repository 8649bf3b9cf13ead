package cdc_test

import (
	"context"
	"testing"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/relay/cdc"
)

// ParkedWALCount is 0 for an outbox with no WAL parking table, and counts
// only the rows with a motiu (the others wait behind one) when there is one.
func TestParkedWALCountCountsOnlyTheParked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	empty := pgtest.NewSchema(t)
	if n, err := cdc.ParkedWALCount(ctx, empty.Pool, empty.Names()); n != 0 || err != nil {
		t.Fatalf("no parking table: %d, %v; want 0, nil", n, err)
	}
	s := pgtest.NewMigratedSchema(t)
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_wal_aparcats (id, lsn, agregat, agregat_id, tipus, versio, carrega, creat_en, motiu)
		SELECT gen_random_uuid(), ('0/' || to_hex(i))::pg_lsn, 'comanda', 'X', 'comanda.creada', 1, '{}', now(), m
		FROM unnest(ARRAY['broker: MESSAGE_TOO_LARGE', NULL, 'schema']) WITH ORDINALITY AS u(m, i)`); err != nil {
		t.Fatal(err)
	}
	if n, err := cdc.ParkedWALCount(ctx, s.Pool, s.Names()); n != 2 || err != nil {
		t.Fatalf("two parked, one waiting: %d, %v; want 2, nil", n, err)
	}
}
