package dlq

import (
	"context"
	"fmt"
)

// Queued is a letter read from a RabbitMQ DLQ, not yet numbered: reading a
// queue is destructive, so the index numbers the letters itself.
type Queued struct {
	Letter *Letter
	// Redelivered is the delivery's flag: the letter may be indexed
	// already (the index committed and the ack was lost).
	Redelivered bool
}

// IndexQueued numbers and indexes letters of one RabbitMQ DLQ (what
// amqpdlq.Backend's Sync read) in one
// transaction, under an advisory lock per (index table, DLQ), and returns
// the new ones and those set aside. A redelivered letter equal to one
// already indexed or set aside is skipped. A letter the index refuses is set
// aside in cartes_refusades with its bytes (its only copy once acked) and
// its number, which the sequence counts too.
func (s *Store) IndexQueued(ctx context.Context, dlqName string, letters []Queued) (added []*Letter, refused []Refusal, err error) {
	ins, err := s.indexQueued(ctx, dlqName, letters)
	return ins.added, ins.refused, err
}

func (s *Store) indexQueued(ctx context.Context, dlqName string, letters []Queued) (inserted, error) {
	fail := func(err error) (inserted, error) { return inserted{}, err }
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return fail(fmt.Errorf("dlq: begin: %w", err))
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", s.table+" "+dlqName); err != nil {
		return fail(fmt.Errorf("dlq: lock %s: %w", dlqName, err))
	}
	var next int64
	if err := tx.QueryRow(ctx, "SELECT COALESCE(GREATEST((SELECT max(offset_dlq) FROM "+s.table+" WHERE topic = $1), "+
		"(SELECT max(offset_dlq) FROM "+s.refused+" WHERE topic = $1)) + 1, 0)",
		dlqName).Scan(&next); err != nil {
		return fail(fmt.Errorf("dlq: sequence of %s: %w", dlqName, err))
	}
	fresh := make([]*Letter, 0, len(letters))
	for _, q := range letters {
		l := q.Letter
		if q.Redelivered {
			keys, vals := headerBytes(l.Headers)
			var seen bool
			same := ` WHERE topic = $1 AND morta_en IS NOT DISTINCT FROM $2
				AND valor = $3 AND capcaleres_claus = $4 AND capcaleres_valors = $5`
			if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+s.table+same+") OR EXISTS (SELECT 1 FROM "+s.refused+same+")",
				dlqName, nullTime(l.DeadAt), nonNil(l.Value), keys, vals).Scan(&seen); err != nil {
				return fail(fmt.Errorf("dlq: look up a redelivered letter of %s: %w", dlqName, err))
			}
			if seen {
				continue
			}
		}
		l.Offset, l.ID = next, KafkaID(dlqName, 0, next)
		next++
		fresh = append(fresh, l)
	}
	ins, err := s.insertTx(ctx, tx, fresh)
	if err != nil {
		return fail(err)
	}
	// A collision cannot happen under the lock; never ack a letter neither
	// indexed nor set aside.
	if n := len(ins.added) + ins.setAside; n != len(fresh) || len(ins.refused) != ins.setAside {
		return fail(fmt.Errorf("dlq: %s: %d of %d letters collided with existing IDs", dlqName, len(fresh)-n, len(fresh)))
	}
	if err := tx.Commit(ctx); err != nil {
		return fail(fmt.Errorf("dlq: commit: %w", err))
	}
	return ins, nil
}
