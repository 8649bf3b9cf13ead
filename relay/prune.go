package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/migrate"
)

// Defaults of pruning.
const (
	// PruneBatchDefault is the number of rows one pruning DELETE removes, each
	// in its own short transaction.
	PruneBatchDefault = 1000
	// PruneBatchMax bounds a pruning batch: larger ones only lengthen the
	// transaction and the WAL burst.
	PruneBatchMax = 100_000
	// PruneIntervalDefault is how often a relay with PruneOlderThan set runs a
	// pruning pass.
	PruneIntervalDefault = time.Minute
)

// ErrPruneConfig is returned by Prune for a retention or batch out of range.
var ErrPruneConfig = errors.New("relay: invalid prune settings")

// Prune deletes the published rows of the outbox (publicat_en IS NOT NULL)
// marked more than olderThan ago, oldest first, in DELETEs of at most batch
// rows (0 means PruneBatchDefault), each its own transaction, until none is
// left older than the cutoff taken when the pass starts. It returns how many
// rows it deleted, also when ctx ends or a statement fails part way (the rows
// of the batches that committed stay deleted).
//
// Pending rows (publicat_en IS NULL, parked ones included) are never touched.
// Rows another transaction holds are skipped (FOR UPDATE SKIP LOCKED), and no
// relay lock (shard, member or aggregate) is taken, so pruning never waits for
// the relay or the writers, nor they for it. olderThan must be positive:
// published rows are what an operator replays from.
func Prune(ctx context.Context, db DBTX, names migrate.Names, olderThan time.Duration, batch int) (int64, error) {
	if olderThan <= 0 {
		return 0, fmt.Errorf("%w: retention %v must be positive", ErrPruneConfig, olderThan)
	}
	if batch == 0 {
		batch = PruneBatchDefault
	}
	if batch < 0 || batch > PruneBatchMax {
		return 0, fmt.Errorf("%w: batch %d is outside 1..%d", ErrPruneConfig, batch, PruneBatchMax)
	}
	del := pruneQuery(names)
	var cutoff time.Time
	rows, err := db.Query(ctx, "SELECT now() - make_interval(secs => $1)", olderThan.Seconds())
	if err != nil {
		return 0, fmt.Errorf("relay: prune: %w", err)
	}
	if _, err := pgx.ForEachRow(rows, []any{&cutoff}, func() error { return nil }); err != nil {
		return 0, fmt.Errorf("relay: prune: %w", err)
	}
	var total int64
	for {
		tag, err := db.Exec(ctx, del, cutoff, batch)
		if err != nil {
			return total, fmt.Errorf("relay: prune: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}

// pruneQuery is one pruning batch: $1 cutoff, $2 batch size. The inner scan
// walks the outbox_publicats index (published rows only) in publicat_en
// order.
func pruneQuery(n migrate.Names) string {
	n = n.WithDefaults()
	table := pgx.Identifier{n.Schema, n.Outbox}.Sanitize()
	return `DELETE FROM ` + table + ` WHERE ctid = ANY (ARRAY(SELECT ctid FROM ` + table + `
		WHERE publicat_en IS NOT NULL AND publicat_en < $1
		ORDER BY publicat_en LIMIT $2 FOR UPDATE SKIP LOCKED))`
}

// prune runs a pruning pass at start and then every PruneInterval until ctx
// ends. A failed pass is logged and counted, and retried at the next tick.
func (r *Relay) prune(ctx context.Context) {
	t := time.NewTicker(r.cfg.PruneInterval)
	defer t.Stop()
	for {
		n, err := Prune(ctx, r.stats, r.cfg.Names, r.cfg.PruneOlderThan, r.cfg.PruneBatch)
		r.m.pruned.Add(float64(n))
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			r.cfg.Logger.Warn("km0 relay: prune pass failed; retrying at the next one", "err", err, "pruned", n)
		case n > 0:
			r.cfg.Logger.Info("km0 relay: pruned published rows", "rows", n, "older_than", r.cfg.PruneOlderThan)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
