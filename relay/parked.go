package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/migrate"
)

// DBTX is what the parking functions need (contract.DBTX): a pool, a
// connection or a transaction.
type DBTX = contract.DBTX

// ParkedRow is one outbox row the relay parked.
type ParkedRow struct {
	ID          uuid.UUID // the row id, id_esdeveniment
	AggregateID string
	Type        string    // tipus ("" if the outbox row is gone)
	Reason      string    // motiu: why the broker or the relay refused it
	ParkedAt    time.Time // aparcat_en
	Waiting     int       // later pending rows of the aggregate waiting behind it
}

// ErrNotParked is returned by Release for an id that is not parked.
var ErrNotParked = errors.New("relay: row is not parked")

// Parked lists the parked rows of the outbox names, oldest first.
func Parked(ctx context.Context, db DBTX, names migrate.Names) ([]ParkedRow, error) {
	names = names.WithDefaults()
	table := pgx.Identifier{names.Schema, names.Outbox}.Sanitize()
	parked := pgx.Identifier{names.Schema, names.Outbox + "_aparcats"}.Sanitize()
	rows, err := db.Query(ctx, `SELECT p.id, p.agregat_id, coalesce(o.tipus, ''), p.motiu, p.aparcat_en,
		(SELECT count(*) FROM `+table+` w WHERE w.agregat_id = p.agregat_id AND w.publicat_en IS NULL AND w.id <> p.id)::int
		FROM `+parked+` p LEFT JOIN `+table+` o ON o.id = p.id ORDER BY p.aparcat_en, p.id`)
	if err != nil {
		return nil, fmt.Errorf("relay: list parked: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ParkedRow, error) {
		var p ParkedRow
		err := r.Scan(&p.ID, &p.AggregateID, &p.Type, &p.Reason, &p.ParkedAt, &p.Waiting)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("relay: list parked: %w", err)
	}
	return out, nil
}

// Release removes the parking of id, so the relay retries the row (and then
// the rows of its aggregate waiting behind it), and wakes the relays. It
// returns ErrNotParked if id is not parked.
func Release(ctx context.Context, db DBTX, names migrate.Names, id uuid.UUID) error {
	n, err := release(ctx, db, names, " WHERE id = $1", id)
	if err != nil {
		return err
	}
	if n == 0 {
		return fmt.Errorf("%w: %s", ErrNotParked, id)
	}
	return nil
}

// ReleaseAll releases every parked row and returns how many it released.
func ReleaseAll(ctx context.Context, db DBTX, names migrate.Names) (int64, error) {
	return release(ctx, db, names, "")
}

func release(ctx context.Context, db DBTX, names migrate.Names, where string, args ...any) (int64, error) {
	names = names.WithDefaults()
	parked := pgx.Identifier{names.Schema, names.Outbox + "_aparcats"}.Sanitize()
	tag, err := db.Exec(ctx, "DELETE FROM "+parked+where, args...)
	if err != nil {
		return 0, fmt.Errorf("relay: release: %w", err)
	}
	if tag.RowsAffected() > 0 {
		if _, err := db.Exec(ctx, "SELECT pg_notify($1, $2)", notifyChannel, names.Schema+"."+names.Outbox); err != nil {
			return tag.RowsAffected(), fmt.Errorf("relay: released, but could not wake the relays: %w", err)
		}
	}
	return tag.RowsAffected(), nil
}
