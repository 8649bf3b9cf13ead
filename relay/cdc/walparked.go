package cdc

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
)

// ParkedWAL lists the parked messages of the WAL-mode outbox names (the
// rows of <outbox>_wal_aparcats with a motiu), oldest first, as
// relay.Parked does for a table-mode outbox. Waiting counts the messages of
// the aggregate kept behind each one (later in the WAL). An error wraps the
// database's; a table-mode outbox has no such table (km0 migrate
// --outbox-mode wal creates it).
func ParkedWAL(ctx context.Context, db outbox.DBTX, names migrate.Names) ([]relay.ParkedRow, error) {
	names = names.WithDefaults()
	t := pgx.Identifier{names.Schema, names.Outbox + migrate.WALParkedSuffix}.Sanitize()
	rows, err := db.Query(ctx, `SELECT p.id, p.agregat_id, p.tipus, p.motiu, p.aparcat_en,
		(SELECT count(*) FROM `+t+` w WHERE w.agregat_id = p.agregat_id AND w.lsn > p.lsn)::int
		FROM `+t+` p WHERE p.motiu IS NOT NULL ORDER BY p.aparcat_en, p.lsn`)
	if err != nil {
		return nil, fmt.Errorf("cdc: list parked: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (relay.ParkedRow, error) {
		var p relay.ParkedRow
		err := r.Scan(&p.ID, &p.AggregateID, &p.Type, &p.Reason, &p.ParkedAt, &p.Waiting)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("cdc: list parked: %w", err)
	}
	return out, nil
}

// ReleaseAllWAL releases every parked message of the WAL-mode outbox names
// (ReleaseWAL for each) and returns how many it released: the relay
// publishes them and the messages behind them within Config.ReleaseCheck.
func ReleaseAllWAL(ctx context.Context, db outbox.DBTX, names migrate.Names) (int64, error) {
	names = names.WithDefaults()
	t := pgx.Identifier{names.Schema, names.Outbox + migrate.WALParkedSuffix}.Sanitize()
	tag, err := db.Exec(ctx, "UPDATE "+t+" SET motiu = NULL WHERE motiu IS NOT NULL")
	if err != nil {
		return 0, fmt.Errorf("cdc: release: %w", err)
	}
	return tag.RowsAffected(), nil
}

// ParkedWALCount counts the parked messages of names in WAL mode (the rows
// of <outbox>_wal_aparcats with a motiu): 0 when the outbox has no WAL
// parking table (a table-mode outbox), so that a listing of the table's
// parked rows can say that the WAL mode has some too.
func ParkedWALCount(ctx context.Context, db relay.Querier, names migrate.Names) (int, error) {
	names = names.WithDefaults()
	t := pgx.Identifier{names.Schema, names.Outbox + migrate.WALParkedSuffix}.Sanitize()
	var exists bool
	if err := db.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", t).Scan(&exists); err != nil || !exists {
		return 0, err
	}
	var n int
	if err := db.QueryRow(ctx, "SELECT count(*) FROM "+t+" WHERE motiu IS NOT NULL").Scan(&n); err != nil {
		return 0, fmt.Errorf("cdc: count parked: %w", err)
	}
	return n, nil
}
