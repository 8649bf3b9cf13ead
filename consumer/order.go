package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
)

// Per-key order (Config.Order PerKey): a sequenced dead-letter queue on top
// of the pipeline, kept in PostgreSQL by package keyorder, in the steps of
// its package doc.
//
//   - One IsBlocked query per batch splits it: the messages of healthy keys
//     take the ordinary path (runOptimistic, batched transactions); those
//     of blocked keys run one transaction each (runBlocked).
//   - A message of a healthy key that fails marks its key blocked, with it
//     as the head, in a transaction that commits before Handle returns, so
//     before the source produces its retry or DLQ copy: nothing behind it
//     can be applied first. The later messages of that key in the batch are
//     parked in that same transaction.
//   - A message behind a blocked head is parked in the transaction that
//     settles it (its offset or ack follows the commit); its inbox key is
//     not recorded.
//   - The head (its retry copy, the original redelivered, or its replay
//     from the DLQ) is applied in a savepoint; on success the messages
//     behind it are released one by one and applied in the same
//     transaction, each in its own savepoint. A released message that fails
//     becomes the head (its stored row stays, so its data is safe until it
//     succeeds), and its retry copy is produced from the store
//     (transport.Settlement.Copy) before the delivery in hand is settled.
//
// Lock order (keyorder): inbox keys, then the key's row, then the effect's
// rows. The head's own inbox key is inserted before ReleaseNext locks the
// key; a released message's key is inserted after, which cannot deadlock:
// no other transaction inserts it (a redelivery of a parked message parks,
// and parking inserts no inbox key).

// splitBlocked returns the heads of the blocked keys among todo (one query,
// no locks), waiting out a database outage like a transaction does.
func (c *Consumer) splitBlocked(l *lane, todo []*item) (map[string]keyorder.Head, error) {
	seen := map[string]bool{}
	var keys []string
	for _, it := range todo {
		if k := string(it.msg.Key); k != "" && !seen[k] {
			seen[k] = true
			keys = append(keys, k)
		}
	}
	var fails int
	for {
		heads, err := c.order.IsBlocked(l.ctx, c.cfg.Pool, c.cfg.Name, keys...)
		if err == nil {
			return heads, nil
		}
		if cerr := c.Err(); cerr != nil {
			return nil, cerr
		}
		c.log.Warn("consumer: per-key order: is blocked", "topic", l.topic, "partition", l.part, "err", err)
		if !c.pause(l, &fails) {
			return nil, fmt.Errorf("consumer: batch abandoned: %w", err)
		}
	}
}

// handleOrdered runs todo in per-key order mode.
func (c *Consumer) handleOrdered(l *lane, todo []*item, fails []failure) ([]failure, error) {
	heads, err := c.splitBlocked(l, todo)
	if err != nil {
		return fails, err
	}
	l.blocked = map[string]bool{}
	var fast, slow []*item
	for _, it := range todo {
		if _, ok := heads[string(it.msg.Key)]; ok && len(it.msg.Key) > 0 {
			slow = append(slow, it)
		} else {
			fast = append(fast, it)
		}
	}
	for len(fast) > 0 {
		// Messages of a key that blocked earlier in this batch are parked.
		var park []*item
		n := 0
		seen := make(map[string]bool, len(fast))
		var run []*item
		for n < len(fast) {
			it := fast[n]
			if l.blocked[string(it.msg.Key)] {
				park = append(park, it)
				n++
				continue
			}
			if seen[it.msg.idempotencyKey] {
				break // a transaction never holds the same id twice
			}
			seen[it.msg.idempotencyKey] = true
			run = append(run, it)
			n++
		}
		if len(park) > 0 {
			for _, it := range park {
				if fails, err = c.runBlocked(l, it, nil, fails); err != nil {
					return fails, err
				}
			}
		}
		if len(run) > 0 {
			if fails, err = c.runOptimistic(l, run, fails); err != nil {
				return fails, err
			}
		}
		fast = fast[n:]
	}
	for _, it := range slow {
		h := heads[string(it.msg.Key)]
		if fails, err = c.runBlocked(l, it, &h, fails); err != nil {
			return fails, err
		}
	}
	return fails, nil
}

// errNotBlocked: the key was released meanwhile; the message takes the
// ordinary path.
var errNotBlocked = errors.New("consumer: key no longer blocked")

// runBlocked runs one message of a key that is blocked: h is its head as
// IsBlocked saw it (nil: blocked earlier in this batch, by another message).
// The head is applied and releases the key; any other message is parked.
func (c *Consumer) runBlocked(l *lane, it *item, h *keyorder.Head, fails []failure) ([]failure, error) {
	var (
		out     []failure
		applied []*item // committed effects (the head and the released ones)
		parked  bool
		dup     bool
	)
	head := h != nil && h.MessageID == it.msg.idempotencyKey
	err := c.inTx(l, []*item{it}, func(ctx context.Context, tx pgx.Tx) error {
		out, applied, parked, dup = nil, nil, false, false
		if head {
			var err error
			out, applied, dup, err = c.applyHead(ctx, tx, it)
			return err
		}
		var err error
		out, parked, dup, err = c.park(ctx, tx, it)
		return err
	})
	if errors.Is(err, errNotBlocked) {
		return c.runOptimistic(l, []*item{it}, fails)
	}
	if err != nil {
		return fails, err
	}
	released := 0
	for _, a := range applied {
		if a != it {
			released++
		}
	}
	switch {
	case dup:
		c.count(l.origin, resDuplicate, 1)
	case parked:
		c.count(l.origin, resParked, 1)
	case head && len(out) > 0 && out[0].it == it:
		// the head failed again: counted by its settlement
	default:
		c.count(l.origin, resProcessed, 1)
	}
	c.count(l.origin, resReleased, int64(released))
	if err := c.afterOrdered(l, it, applied); err != nil {
		return fails, err
	}
	return append(fails, out...), nil
}

// afterOrdered runs OnCommit on the fresh effects of an ordered transaction
// and the AfterCommit crash point on its message.
func (c *Consumer) afterOrdered(l *lane, it *item, applied []*item) error {
	if c.cfg.OnCommit != nil && len(applied) > 0 {
		c.cfg.OnCommit(l.ctx, messages(applied))
	}
	if h := c.faults.AfterCommit; h != nil {
		return c.hook(h(l.ctx, []*Message{it.msg}))
	}
	return nil
}

// park parks it behind its key's head, unless it was applied already (a
// duplicate: nothing changes). Behind a dead-lettered head under
// DeadLetterBlocked it is also dead-lettered as blocked by the head. A
// duplicate of a key whose head is a released message kept in the store
// re-issues that head's copy (the crash between the release transaction and
// the copy).
func (c *Consumer) park(ctx context.Context, tx pgx.Tx, it *item) (out []failure, parked, dup bool, err error) {
	key := string(it.msg.Key)
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, false, false, err
	}
	p, again, err := c.order.Park(ctx, sp, c.cfg.Name, key, stored(it))
	if errors.Is(err, keyorder.ErrNotBlocked) {
		_ = sp.Rollback(ctx)
		return nil, false, false, errNotBlocked
	}
	if errors.Is(err, keyorder.ErrInput) {
		// A header PostgreSQL cannot store: it cannot wait here, and
		// applying it would break the order. Dead-letter it.
		_ = sp.Rollback(ctx)
		return []failure{{it: it, kind: outcome.KindPermanent, err: outcome.Permanent(err)}}, false, false, nil
	}
	if err != nil {
		return nil, false, false, err
	}
	// The key's row is locked now: a release in flight has committed, and
	// the inbox shows whether it applied this message.
	var applied bool
	if err := sp.QueryRow(ctx, c.isApplied, it.msg.idempotencyKey, c.cfg.Name).Scan(&applied); err != nil {
		return nil, false, false, err
	}
	if applied {
		if err := sp.Rollback(ctx); err != nil {
			return nil, false, false, err
		}
		out, err := c.reissue(ctx, tx, it)
		return out, false, true, err
	}
	if err := sp.Commit(ctx); err != nil {
		return nil, false, false, err
	}
	if p.State == keyorder.DeadLetteredBehind {
		// A message parked already (again) goes back to the DLQ too: a
		// replay of it alone, or a copy a crash lost.
		_ = again
		heads, err := c.order.IsBlocked(ctx, tx, c.cfg.Name, key)
		if err != nil {
			return nil, false, false, err
		}
		return []failure{{it: it, kind: outcome.KindPermanent, reason: keyorder.BlockedReason(heads[key].MessageID)}}, true, false, nil
	}
	return nil, true, false, nil
}

// reissue: it is a duplicate of a blocked key. If the head is a released
// message whose row is still in the store, its copy may never have been
// produced (a crash after the release transaction): produce it again from
// the store. A second copy is harmless (the inbox absorbs it).
func (c *Consumer) reissue(ctx context.Context, tx pgx.Tx, it *item) ([]failure, error) {
	seq, ok, err := c.order.Sequence(ctx, tx, c.cfg.Name, string(it.msg.Key))
	if err != nil || !ok {
		return nil, err
	}
	for _, p := range seq.Behind {
		if p.ID != seq.Head.MessageID {
			continue
		}
		f := failure{it: c.released(p), on: it.d, kind: outcome.KindTransient, err: errors.New(cmp.Or(seq.Head.LastError, "?"))}
		if seq.Head.Reason == keyorder.ReasonDeadLettered {
			f.reason = outcome.Truncate(contract.ReasonPermanent+cmp.Or(seq.Head.LastError, "?"), 200)
		}
		return []failure{f}, nil
	}
	return nil, nil
}

// applyHead applies the head it and releases the messages behind it in
// order, all in tx; a failure of the head, or of a released message, makes
// that message the key's head.
func (c *Consumer) applyHead(ctx context.Context, tx pgx.Tx, it *item) (out []failure, applied []*item, dup bool, err error) {
	key := string(it.msg.Key)
	ok, herr, err := c.applyOne(ctx, tx, it)
	if err != nil {
		return nil, nil, false, err
	}
	switch {
	case herr != nil && c.final(c.failureOf(it, herr)):
		// A final refusal: dead-lettered, and the key goes on without it.
		out = append(out, c.failureOf(it, herr))
	case herr != nil:
		f := c.failureOf(it, herr)
		out, err := c.markFailed(ctx, tx, f, nil)
		return out, nil, false, err
	case ok:
		applied = append(applied, it)
	default:
		dup = true
	}
	cur := it.msg.idempotencyKey
	for {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return nil, nil, false, err
		}
		p, more, err := c.order.ReleaseNext(ctx, sp, c.cfg.Name, key, cur)
		if errors.Is(err, keyorder.ErrNotHead) {
			// Another copy of the head released the key first.
			return out, applied, dup, sp.Rollback(ctx)
		}
		if err != nil {
			return nil, nil, false, err
		}
		if !more {
			return out, applied, dup, sp.Commit(ctx)
		}
		if p.ID == cur { // the head's own stored row (a released message that had failed)
			if err := sp.Commit(ctx); err != nil {
				return nil, nil, false, err
			}
			continue
		}
		rit := c.released(p)
		var rok bool
		var rerr error
		if rit.msg.Envelope == nil {
			rerr = rit.decodeErr
		} else if rok, rerr, err = c.applyOne(ctx, sp, rit); err != nil {
			return nil, nil, false, err
		}
		if rerr != nil {
			f := c.failureOf(rit, rerr)
			f.on = it.d
			if c.final(f) {
				// A final refusal: dead-lettered from the store (applyOne
				// rolled its effect back), and the release goes on.
				if err := sp.Commit(ctx); err != nil {
					return nil, nil, false, err
				}
				out = append(out, f)
				cur = p.ID
				continue
			}
			// Undo the release of p: it stays stored, and becomes the head.
			if err := sp.Rollback(ctx); err != nil {
				return nil, nil, false, err
			}
			more, err := c.markFailed(ctx, tx, f, nil)
			return append(out, more...), applied, dup, err
		}
		if err := sp.Commit(ctx); err != nil {
			return nil, nil, false, err
		}
		if rok {
			applied = append(applied, rit)
		}
		cur = p.ID
	}
}

// applyOne records it's key and runs its handler in a savepoint of tx: ok
// false with no error for a duplicate; herr is the handler's failure (the
// savepoint rolled back). err is a conflict or an infrastructure error:
// the whole transaction reruns.
func (c *Consumer) applyOne(ctx context.Context, tx pgx.Tx, it *item) (ok bool, herr, err error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return false, nil, err
	}
	fresh, err := c.recordKeys(ctx, sp, []*item{it})
	if err != nil {
		if pgerr.DataRefused(err) {
			_ = sp.Rollback(ctx)
			return false, outcome.Permanent(fmt.Errorf("idempotency key refused: %w", err)), nil
		}
		return false, nil, err
	}
	if !fresh[it.msg.idempotencyKey] {
		return false, nil, sp.Commit(ctx)
	}
	failed := func(herr error) (bool, error, error) {
		if end := txEnding(ctx, tx, "handler", herr); end != nil {
			return false, nil, end
		}
		if err := sp.Rollback(ctx); err != nil {
			return false, nil, err
		}
		return false, herr, nil
	}
	if c.outcomesOnly() {
		// As in tryTx: a refusal keeps what the handler wrote for it.
		r, herr := c.callOutcomes(ctx, sp, []*item{it})
		switch {
		case herr != nil:
			return failed(herr)
		case len(r) > 0:
			return false, r[0].err, sp.Commit(ctx)
		}
		return true, nil, sp.Commit(ctx)
	}
	if herr := c.call(ctx, sp, it.msg); herr != nil {
		return failed(herr)
	}
	return true, nil, sp.Commit(ctx)
}

// final reports whether f is a final refusal (Config.FinalFailure): dead-
// lettered without blocking its key.
func (c *Consumer) final(f failure) bool {
	return c.cfg.FinalFailure != nil && f.kind == outcome.KindPermanent && f.err != nil && c.cfg.FinalFailure(f.err)
}

func (c *Consumer) failureOf(it *item, err error) failure {
	kind, delay := outcome.Classify(err, c.cfg.Classifier)
	return failure{it: it, kind: kind, wait: delay, err: err}
}

// blockKey marks f's key blocked by f's message (it failed in a transaction
// that rolled back) and parks rest's messages of that key behind it, in one
// transaction committed before the source copies f. It returns rest without
// them, and the failures to settle besides f (the messages dead-lettered as
// blocked by it).
func (c *Consumer) blockKey(l *lane, f failure, rest []*item) ([]*item, []failure, error) {
	if c.final(f) {
		return rest, []failure{f}, nil
	}
	key := string(f.it.msg.Key)
	var behind, keep []*item
	for _, it := range rest {
		if string(it.msg.Key) == key {
			behind = append(behind, it)
		} else {
			keep = append(keep, it)
		}
	}
	var out []failure
	var parked, dups int64
	err := c.inTx(l, append([]*item{f.it}, behind...), func(ctx context.Context, tx pgx.Tx) error {
		var err error
		out, parked, dups = nil, 0, 0
		if out, err = c.markFailed(ctx, tx, f, nil); err != nil {
			return err
		}
		for _, it := range behind {
			more, p, d, err := c.park(ctx, tx, it)
			if err != nil {
				return err // errNotBlocked cannot happen: tx holds the key's row
			}
			out = append(out, more...)
			if p {
				parked++
			}
			if d {
				dups++
			}
		}
		return nil
	})
	if err != nil {
		return rest, nil, err
	}
	l.blocked[key] = true
	c.count(l.origin, resParked, parked)
	c.count(l.origin, resDuplicate, dups)
	if h := c.faults.AfterCommit; h != nil {
		if err := c.hook(h(l.ctx, []*Message{f.it.msg})); err != nil {
			return rest, nil, err
		}
	}
	return keep, out, nil
}

// markFailed makes f's message its key's head in tx: waiting for a retry,
// or dead-lettered (then the messages parked behind it are dead-lettered as
// blocked by it under DeadLetterBlocked). It returns f and those as
// failures to settle.
func (c *Consumer) markFailed(ctx context.Context, tx pgx.Tx, f failure, _ []*item) ([]failure, error) {
	key := string(f.it.msg.Key)
	dead := c.dead(f)
	h := keyorder.Head{MessageID: f.it.msg.idempotencyKey, Reason: keyorder.ReasonRetry,
		LastError: outcome.Truncate(errText(f.err), 200)}
	if dead {
		h.Reason = keyorder.ReasonDeadLettered
	}
	if err := c.order.MarkHeadBlocked(ctx, tx, c.cfg.Name, key, h); err != nil {
		return nil, err
	}
	out := []failure{f}
	if !dead {
		return out, nil
	}
	if _, err := c.order.DeadLetterBehind(ctx, tx, c.cfg.Name, key, h.MessageID); err != nil {
		return nil, err
	}
	if c.cfg.Behind == StayParked {
		return out, nil
	}
	// Every message behind it goes to the DLQ as blocked by it, also those
	// an earlier attempt already copied (a crash may have lost the copies).
	seq, ok, err := c.order.Sequence(ctx, tx, c.cfg.Name, key)
	if err != nil || !ok {
		return out, err
	}
	on := f.on
	if on == nil {
		on = f.it.d
	}
	for _, p := range seq.Behind {
		if p.ID == h.MessageID {
			continue
		}
		out = append(out, failure{it: c.released(p), on: on, kind: outcome.KindPermanent, reason: keyorder.BlockedReason(h.MessageID)})
	}
	return out, nil
}

// stored is what keyorder keeps of it.
func stored(it *item) keyorder.Message {
	d := it.d
	hs := make([]keyorder.Header, len(d.Headers))
	for i, h := range d.Headers {
		hs[i] = keyorder.Header(h)
	}
	return keyorder.Message{ID: it.msg.idempotencyKey, Topic: d.Origin, Partition: d.Partition, Offset: d.Offset,
		Value: d.Value, Headers: hs, Timestamp: d.Timestamp}
}

// released is the item of a stored message: a delivery rebuilt from the
// store (Ref nil: the source copies it from these fields), decoded.
func (c *Consumer) released(p keyorder.Parked) *item {
	hs := make([]transport.Header, len(p.Headers))
	for i, h := range p.Headers {
		hs[i] = transport.Header(h)
	}
	d := &transport.Delivery{
		Message: &transport.Message{Topic: p.Topic, Key: []byte(p.Key), Value: p.Value, Headers: hs},
		Origin:  p.Topic, Partition: p.Partition, Offset: p.Offset, Timestamp: p.Timestamp, Attempt: 1,
	}
	m := &Message{Message: d.Message, OriginalTopic: p.Topic, Partition: p.Partition, Offset: p.Offset, Attempt: 1}
	it := &item{d: d, msg: m}
	env, err := c.decode(d)
	if err == nil && env == nil {
		err = errNoID
	}
	if err != nil {
		it.decodeErr = outcome.Permanent(err)
		m.idempotencyKey = p.ID
		return it
	}
	m.Envelope = env
	m.idempotencyKey = idempotencyKey(env)
	return it
}

// inTx runs fn in a transaction and commits it, rerunning it in place after
// a conflict and after an infrastructure error (as runOptimistic does). fn's
// errNotBlocked rolls back and is returned.
func (c *Consumer) inTx(l *lane, msgs []*item, fn func(ctx context.Context, tx pgx.Tx) error) error {
	var fails, conflicts int
	for {
		err := c.oneTx(l.ctx, msgs, fn)
		if cerr := c.Err(); cerr != nil {
			return cerr
		}
		if err == nil || errors.Is(err, errNotBlocked) {
			return err
		}
		if code := pgerr.Conflict(err); code != "" && l.ctx.Err() == nil {
			if !c.conflict(l, code, err, &conflicts) {
				return fmt.Errorf("consumer: batch abandoned after a conflict: %w", err)
			}
			continue
		}
		c.log.Warn("consumer: per-key order: transaction", "topic", l.topic, "partition", l.part, "err", err)
		if !c.pause(l, &fails) {
			return fmt.Errorf("consumer: batch abandoned: %w", err)
		}
	}
}

func (c *Consumer) oneTx(ctx context.Context, msgs []*item, fn func(ctx context.Context, tx pgx.Tx) error) error {
	select {
	case c.sem <- struct{}{}:
		defer func() { <-c.sem }()
	case <-ctx.Done():
		return ctx.Err()
	}
	tx, err := c.cfg.Pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	if err := fn(ctx, tx); err != nil {
		return err
	}
	if h := c.faults.BeforeTxCommit; h != nil {
		if err := c.hook(h(ctx, tx, messages(msgs))); err != nil {
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// checkOrderTables reports a clear error when the keyorder tables are
// missing (their migrations were not applied).
func (c *Consumer) checkOrderTables(ctx context.Context) error {
	var b, p *string
	schema := c.cfg.Names.Schema
	err := c.cfg.Pool.QueryRow(ctx, `SELECT to_regclass($1)::text, to_regclass($2)::text`,
		pgx.Identifier{schema, "claus_bloquejades"}.Sanitize(), pgx.Identifier{schema, "missatges_aparcats"}.Sanitize()).Scan(&b, &p)
	if err != nil {
		return fmt.Errorf("consumer %s: per-key order: check its tables: %w", c.cfg.Name, err)
	}
	if b == nil || p == nil {
		return fmt.Errorf("consumer %s: per-key order needs the tables claus_bloquejades and missatges_aparcats in schema %q: "+
			"apply the keyorder migrations (km0 migrate, or migrate.Up with keyorder.Migrations)", c.cfg.Name, schema)
	}
	return nil
}
