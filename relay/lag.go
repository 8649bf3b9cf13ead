package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/migrate"
)

// Querier is what MeasureLag needs: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// MeasureLag returns the relay lag of the outbox names (schema and table;
// defaults as migrate.Names) in db without a running Relay: the same query
// Relay.Lag and km0_relay_pending_rows use. Tools that watch many outboxes
// (km0 lag, the console) call it.
func MeasureLag(ctx context.Context, db Querier, names migrate.Names) (Lag, error) {
	var l Lag
	var secs float64
	if err := db.QueryRow(ctx, newQueries(names, false).lag).Scan(&l.Pending, &secs); err != nil {
		return Lag{}, fmt.Errorf("relay: lag: %w", err)
	}
	l.Oldest = time.Duration(secs * float64(time.Second))
	return l, nil
}
