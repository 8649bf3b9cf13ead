package dlq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/outcome"
)

// MaxIndexedText bounds, in bytes, each text column of the index that comes
// from a letter's headers (motiu, topic_original, tipus, id_esdeveniment,
// grup_consumidor): two of them side by side (topic_original and motiu in
// one index) stay well below PostgreSQL's btree row limit of 2,704 bytes.
// Longer text is cut on a rune boundary in the index; the stored headers
// (capcaleres_*) keep it whole.
const MaxIndexedText = 1024

// RefusedTable is the table of the letters the index refused
// (cartes_refusades, migration 003_cartes_refusades.sql).
const RefusedTable = "cartes_refusades"

// Refusal is a letter the index refused: PostgreSQL would not take its row
// even bounded to the columns (Letter.bound). It is set aside in
// cartes_refusades, with its bytes, instead of stopping the letters behind
// it.
type Refusal struct {
	ID        string    `json:"id"`
	Topic     string    `json:"topic"` // the DLQ topic or queue
	Partition int32     `json:"particio"`
	Offset    int64     `json:"offset"`
	Code      string    `json:"codi_error"` // SQLSTATE, e.g. 23514
	Error     string    `json:"error"`      // PostgreSQL's message, cut to MaxIndexedText
	DeadAt    time.Time `json:"morta_en"`   // zero when unknown
	At        time.Time `json:"refusada_en"`
}

// bound makes l fit the columns of the index: intents in [0, MaxInt32]
// (INTEGER), the original position -1 (NULL) when negative, and each text
// storable (pgText: no NUL, valid UTF-8) and at most MaxIndexedText bytes.
// The headers are left as they are: they are stored as bytes.
func (l *Letter) bound() {
	l.Attempts = min(max(l.Attempts, 0), math.MaxInt32)
	l.OriginalPartition = max(l.OriginalPartition, -1)
	l.OriginalOffset = max(l.OriginalOffset, -1)
	for _, s := range []*string{&l.OriginalTopic, &l.Reason, &l.Type, &l.EventID, &l.ConsumerGroup} {
		*s = indexText(*s)
	}
}

// indexText is s made storable (pgText) and cut to MaxIndexedText bytes on
// a rune boundary.
func indexText(s string) string { return outcome.Truncate(pgText(s), MaxIndexedText) }

// rowRefused reports whether err is PostgreSQL refusing a row for what it
// holds, the same on every try (pgerr.DataRefused, pgerr.Integrity), as
// opposed to the database being unavailable or the schema missing.
func rowRefused(err error) bool { return pgerr.DataRefused(err) || pgerr.Integrity(err) }

// inserted is what insertTx did.
type inserted struct {
	added    []*Letter // indexed for the first time
	refused  []Refusal // set aside for the first time
	setAside int       // set aside by this call, the first time or again
}

// insertTx indexes letters in tx, bounded to the columns. The batch goes in
// one statement pipeline under a savepoint; if PostgreSQL refuses a row of
// it (rowRefused), the batch is rolled back to the savepoint and the letters
// are inserted one by one, each under its own savepoint, and a letter that
// is refused again is set aside in cartes_refusades. Any other error is
// returned, and the caller retries the whole batch.
func (s *Store) insertTx(ctx context.Context, tx pgx.Tx, letters []*Letter) (inserted, error) {
	if len(letters) == 0 {
		return inserted{}, nil
	}
	for _, l := range letters {
		l.bound()
	}
	added, err := s.underSavepoint(ctx, tx, letters)
	if err == nil || !rowRefused(err) {
		return inserted{added: added}, err
	}
	var res inserted
	for _, l := range letters {
		a, err := s.underSavepoint(ctx, tx, []*Letter{l})
		if err == nil {
			res.added = append(res.added, a...)
			continue
		}
		if !rowRefused(err) {
			return inserted{}, err
		}
		r, fresh, err := s.setAsideTx(ctx, tx, l, err)
		if err != nil {
			return inserted{}, err
		}
		res.setAside++
		if fresh {
			res.refused = append(res.refused, r)
		}
	}
	return res, nil
}

// underSavepoint runs insertBatch under a savepoint of tx, rolled back to if
// it fails, so that tx can go on.
func (s *Store) underSavepoint(ctx context.Context, tx pgx.Tx, letters []*Letter) ([]*Letter, error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("dlq: savepoint: %w", err)
	}
	added, err := s.insertBatch(ctx, sp, letters)
	if err != nil {
		if rerr := sp.Rollback(ctx); rerr != nil {
			return nil, errors.Join(err, fmt.Errorf("dlq: roll back to the savepoint: %w", rerr))
		}
		return nil, err
	}
	if err := sp.Commit(ctx); err != nil {
		return nil, fmt.Errorf("dlq: release the savepoint: %w", err)
	}
	return added, nil
}

// setAsideTx records l, which the index refused with cause, in
// cartes_refusades, and reports whether it was not there yet.
func (s *Store) setAsideTx(ctx context.Context, tx pgx.Tx, l *Letter, cause error) (Refusal, bool, error) {
	r := Refusal{ID: l.ID, Topic: l.Topic, Partition: l.Partition, Offset: l.Offset, DeadAt: l.DeadAt}
	var pe *pgconn.PgError
	if errors.As(cause, &pe) {
		r.Code, r.Error = pe.Code, indexText(pe.Message)
	}
	keys, vals := headerBytes(l.Headers)
	err := tx.QueryRow(ctx, `INSERT INTO `+s.refused+` (id, topic, particio, offset_dlq, codi_error, error,
		morta_en, clau, valor, capcaleres_claus, capcaleres_valors)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
		ON CONFLICT (id) DO NOTHING RETURNING refusada_en`,
		r.ID, pgText(r.Topic), r.Partition, r.Offset, r.Code, r.Error, nullTime(r.DeadAt), l.Key, nonNil(l.Value),
		keys, vals).Scan(&r.At)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return r, false, nil
	case err != nil:
		return r, false, fmt.Errorf("dlq: set aside %s (refused: %v): %w", l.ID, cause, err)
	}
	r.At = r.At.UTC()
	return r, true, nil
}

// refusedWhere returns the WHERE clause of cartes_refusades for f: only its
// Topic applies (a DLQ topic, or an original topic for its <topic>.dlq).
func refusedWhere(f Filter, args *[]any) string {
	if f.Topic == "" {
		return ""
	}
	t := f.Topic
	if !strings.HasSuffix(t, contract.DLQSuffix) {
		t += contract.DLQSuffix
	}
	*args = append(*args, t)
	return " WHERE topic = $1"
}

// Refused returns the letters the index refused and set aside, oldest
// first. Only f.Topic applies (a DLQ topic or an original topic); the other
// conditions select by columns a refused letter does not have.
func (s *Store) Refused(ctx context.Context, f Filter) ([]Refusal, error) {
	var args []any
	rows, err := s.db.Query(ctx, `SELECT id, topic, particio, offset_dlq, codi_error, error, morta_en, refusada_en FROM `+
		s.refused+refusedWhere(f, &args)+" ORDER BY refusada_en, topic, particio, offset_dlq", args...)
	if err != nil {
		return nil, fmt.Errorf("dlq: refused letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Refusal, error) {
		var r Refusal
		var dead *time.Time
		err := row.Scan(&r.ID, &r.Topic, &r.Partition, &r.Offset, &r.Code, &r.Error, &dead, &r.At)
		r.DeadAt, r.At = derefTime(dead), r.At.UTC()
		return r, err
	})
	if err != nil {
		return nil, fmt.Errorf("dlq: refused letters: %w", err)
	}
	return out, nil
}

// refusedCount counts the letters Refused returns for f.
func (s *Store) refusedCount(ctx context.Context, f Filter) (int, error) {
	var args []any
	var n int
	if err := s.db.QueryRow(ctx, "SELECT count(*) FROM "+s.refused+refusedWhere(f, &args), args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("dlq: count the refused letters: %w", err)
	}
	return n, nil
}

// ReportRefused raises the alert of each letter set aside for the first
// time: Alerter.Refused, or, without an Alerter, the same error line on log.
// Service.Sync calls it; an indexer of a Backend (kafkadlq.Indexer) calls it
// for what it indexes.
func ReportRefused(ctx context.Context, a *Alerter, log *slog.Logger, rs []Refusal) {
	for _, r := range rs {
		if a != nil {
			a.Refused(ctx, r)
		} else {
			logRefused(ctx, log, r)
		}
	}
}

// logRefused writes the one error line of a refused letter.
func logRefused(ctx context.Context, log *slog.Logger, r Refusal) {
	log.LogAttrs(ctx, slog.LevelError, "dlq: letter refused by the index; set aside in "+RefusedTable,
		slog.String("id", r.ID), slog.String("topic", r.Topic), slog.String("codi_error", r.Code),
		slog.String("error", r.Error))
}
