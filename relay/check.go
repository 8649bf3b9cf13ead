package relay

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/migrate"
)

// CheckOutbox returns an error naming the fix (the km0 migrate command line)
// when the outbox names does not exist, or lacks a column the relays read
// (capcaleres, migration 004); with wal (an outbox.ModeWAL outbox, streamed
// by package relay/cdc), when the WAL mode's parking table
// <outbox>_wal_aparcats (migration 005) does not exist. A command checks it
// once at start, so that a relay over an unmigrated outbox refuses at once
// instead of failing every claim.
func CheckOutbox(ctx context.Context, db Querier, names migrate.Names, wal bool) error {
	names = names.WithDefaults()
	if wal {
		var exists bool
		parked := names.Outbox + migrate.WALParkedSuffix
		if err := db.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{names.Schema, parked}.Sanitize()).Scan(&exists); err != nil {
			return err
		}
		if !exists {
			return fmt.Errorf("table %s.%s does not exist: run km0 migrate --schema %s --outbox-table %s --outbox-mode wal first",
				names.Schema, parked, names.Schema, names.Outbox)
		}
		return nil
	}
	var exists, headers bool
	if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, EXISTS (SELECT 1 FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = 'capcaleres' AND NOT attisdropped)`,
		pgx.Identifier{names.Schema, names.Outbox}.Sanitize()).Scan(&exists, &headers); err != nil {
		return err
	}
	if !exists {
		return fmt.Errorf("table %s.%s does not exist: run km0 migrate --schema %s first", names.Schema, names.Outbox, names.Schema)
	}
	if !headers {
		return fmt.Errorf("table %s.%s has no capcaleres column: run km0 migrate --schema %s --outbox-table %s first",
			names.Schema, names.Outbox, names.Schema, names.Outbox)
	}
	return nil
}
