// Package inbox is the idempotent consumer (inbox pattern): it records
// the idempotency key (id_missatge, consumidor) in missatges_processats and runs
// the effect in the same database transaction. Either both persist or neither
// does, so a redelivered message is recognised as a duplicate and changes
// nothing, and a crash mid-transaction leaves no key behind to swallow the retry.
package inbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/migrate"
)

// Result says what Process did.
type Result int

const (
	// Processed: the key was new and the effect committed with it.
	Processed Result = iota + 1
	// Duplicate: the key was already recorded; the effect did not run.
	Duplicate
)

func (r Result) String() string {
	switch r {
	case Processed:
		return "processat"
	case Duplicate:
		return "duplicat"
	default:
		return "?"
	}
}

// RetentionDefault is how long keys are kept: the default topic retention.
// Past it no redelivery can arrive, so a key can go.
const RetentionDefault = 14 * 24 * time.Hour

// Beginner starts transactions: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx
// (which then nests through a savepoint).
type Beginner = contract.Beginner

// Config configures an Inbox. The zero value uses CONTRACT.md's names.
type Config struct {
	Names migrate.Names // schema and table; default public.missatges_processats
	// Retention is the age past which Purge deletes keys. Default RetentionDefault.
	Retention time.Duration
}

// Inbox records processed messages. It is safe for concurrent use.
type Inbox struct {
	retention time.Duration
	insert    string
	purge     string
	table     string
}

// New returns an Inbox for cfg.
func New(cfg Config) *Inbox {
	cfg.Names = cfg.Names.WithDefaults()
	if cfg.Retention <= 0 {
		cfg.Retention = RetentionDefault
	}
	table := pgx.Identifier{cfg.Names.Schema, cfg.Names.Processats}.Sanitize()
	return &Inbox{
		retention: cfg.Retention,
		table:     table,
		insert: "INSERT INTO " + table + " (id_missatge, consumidor) VALUES ($1, $2) " +
			"ON CONFLICT DO NOTHING RETURNING true",
		purge: "DELETE FROM " + table + " WHERE processat_en < now() - $1::interval",
	}
}

// Table returns the quoted, qualified table name.
func (i *Inbox) Table() string { return i.table }

// ErrStore is wrapped by the errors of Process that come from the database
// rather than from the effect: BEGIN, recording the key (for a reason other
// than the key itself) or COMMIT failed. Nothing is known to have persisted,
// or (COMMIT) the outcome is unknown; either way the message must be tried
// again as it is, in place, and not counted as a failed attempt of the
// message: a database restart must not walk healthy messages to a DLQ.
var ErrStore = errors.New("inbox: database unavailable")

// CheckConsumer reports a consumidor name the key table cannot store on every
// insert: over 256 bytes, with a NUL byte, or not valid UTF-8. Configurations
// check it up front; otherwise every message would fail on its key and walk
// to a dead-letter queue.
func CheckConsumer(name string) error {
	switch {
	case name == "":
		return errors.New("inbox: consumidor is empty")
	case len(name) > maxConsumerBytes:
		return fmt.Errorf("inbox: consumidor of %d bytes, over the limit of %d", len(name), maxConsumerBytes)
	case strings.IndexByte(name, 0) >= 0 || !utf8.ValidString(name):
		return fmt.Errorf("inbox: consumidor %q holds a NUL byte or invalid UTF-8", name)
	}
	return nil
}

const maxConsumerBytes = 256

// ErrEmptyKey is returned for an empty consumer or message id.
var ErrEmptyKey = errors.New("inbox: empty consumidor or id_missatge")

// Process runs effect at most once per (messageID, consumer): in one
// transaction it records the key and, if the key was new, runs effect and
// commits. If the key exists it returns Duplicate without running effect.
// If effect (or the commit) fails, the key and the effect both roll back and
// the error is returned as it is, so its outcome classification survives.
func (i *Inbox) Process(ctx context.Context, db Beginner, consumer, messageID string, effect func(tx pgx.Tx) error) (Result, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("%w: begin: %w", ErrStore, err)
	}
	res, err := i.ProcessTx(ctx, tx, consumer, messageID, effect)
	if err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		if !pgerr.Unavailable(err) {
			return 0, fmt.Errorf("inbox: commit refused: %w", err) // about this transaction: a failure of the message
		}
		return 0, fmt.Errorf("%w: commit: %w", ErrStore, err)
	}
	return res, nil
}

// ProcessTx is Process inside a transaction the caller owns and commits. On an
// error the caller must roll back (or roll back to a savepoint taken before).
func (i *Inbox) ProcessTx(ctx context.Context, tx pgx.Tx, consumer, messageID string, effect func(tx pgx.Tx) error) (Result, error) {
	if consumer == "" || messageID == "" {
		return 0, ErrEmptyKey
	}
	var inserted bool
	err := tx.QueryRow(ctx, i.insert, messageID, consumer).Scan(&inserted)
	if errors.Is(err, pgx.ErrNoRows) {
		return Duplicate, nil
	}
	if err != nil {
		if !pgerr.Unavailable(err) {
			return 0, fmt.Errorf("inbox: record key: %w", err) // refused as data: a failure of the message
		}
		return 0, fmt.Errorf("%w: record key: %w", ErrStore, err)
	}
	if err := effect(tx); err != nil {
		if tx.Conn().IsClosed() {
			// The effect failed because our own connection died (a
			// database restart, a terminated backend): nothing persisted and
			// the message did nothing wrong. Any other error, a network one
			// from another service included, stays the effect's.
			return 0, fmt.Errorf("%w: connection lost during the effect: %w", ErrStore, err)
		}
		return 0, err
	}
	return Processed, nil
}

// Seen reports whether (messageID, consumer) is recorded.
func (i *Inbox) Seen(ctx context.Context, db pgx.Tx, consumer, messageID string) (bool, error) {
	var ok bool
	err := db.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+i.table+" WHERE id_missatge = $1 AND consumidor = $2)", messageID, consumer).Scan(&ok)
	return ok, err
}

// Purge deletes keys older than the retention and returns how many it deleted.
func (i *Inbox) Purge(ctx context.Context, db Beginner) (int64, error) {
	return i.PurgeOlderThan(ctx, db, i.retention)
}

// PurgeOlderThan deletes keys older than age.
func (i *Inbox) PurgeOlderThan(ctx context.Context, db Beginner, age time.Duration) (int64, error) {
	if age <= 0 { // would delete every key, and with them every guarantee against duplicates
		return 0, fmt.Errorf("inbox: purge: age %v must be positive", age)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	tag, err := tx.Exec(ctx, i.purge, fmt.Sprintf("%d microseconds", age.Microseconds()))
	if err != nil {
		return 0, fmt.Errorf("inbox: purge: %w", err)
	}
	return tag.RowsAffected(), tx.Commit(ctx)
}
