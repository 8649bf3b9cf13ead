package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/pause"
	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
)

// item is one delivery on its way through a batch.
type item struct {
	d         *transport.Delivery
	msg       *Message
	dup       bool  // set by tryTx: the key was already recorded
	decodeErr error // a stored message (per-key order) that does not decode
}

// failure is a failed attempt, to be retried or dead-lettered.
type failure struct {
	it   *item
	kind outcome.Kind
	wait time.Duration // RetryAfter's delay, 0 for the configured backoff
	err  error
	// on, when set, is the delivery in hand that carries the settlement of
	// it, a message of the per-key order store (transport.Settlement.Copy).
	on *transport.Delivery
	// reason, when set, dead-letters it now with this motiu (a message
	// blocked by its key's dead-lettered head).
	reason string
}

// lane is the batch in hand: the context of its work (cancelled when the
// source abandons work or the consumer crashes), the source's stop signal,
// and where it comes from (logs, metrics).
type lane struct {
	ctx    context.Context
	stop   <-chan struct{}
	origin string // domain topic or work queue
	topic  string // the topic or queue read (a .retry topic, a shard queue)
	part   int32
	// blocked are the keys a failure blocked during this batch (per-key
	// order): their later messages are parked.
	blocked map[string]bool
}

// PanicError is the error of a handler that panicked: a transient failure of
// that attempt. Stack is the goroutine's stack at the panic.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panic: %v", e.Value) }

// bulkDeleteSQL deletes, in the batch's transaction, the keys of the
// messages a BatchOutcomeHandler refused: the refusal leaves no key behind.
func bulkDeleteSQL(table string) string {
	return "DELETE FROM " + table + " WHERE consumidor = $2::text AND id_missatge = ANY($1::text[])"
}

// bulkInsertSQL records the keys of a whole batch in one statement and returns
// those that were new; the others are duplicates. ON CONFLICT DO NOTHING
// waits on a key another transaction holds uncommitted, so two members that
// both got a record (a rebalance, a zombie) are serialised on its key.
// The keys are inserted in sorted order, so two transactions that share
// keys take their row locks in one order and cannot deadlock on them.
func bulkInsertSQL(table string) string {
	return "INSERT INTO " + table + " (id_missatge, consumidor) SELECT unnest($1::text[]), $2::text " +
		"ON CONFLICT DO NOTHING RETURNING id_missatge"
}

// handle runs a batch of one lane: decode and filter outside any
// transaction, then run the rest idempotently (runOptimistic). It returns
// the failed attempts as settlements for the source to carry out; every
// other delivery is done. An error means the consumer crashed or the batch
// was abandoned (lane stopped, shutdown timeout): nothing of the batch may be
// settled.
func (c *Consumer) handle(ctx context.Context, b *transport.Batch) ([]*transport.Settlement, error) {
	if len(b.Deliveries) == 0 {
		return nil, nil
	}
	if err := c.cfg.Pause.wait(ctx, b.Stop, c.crashCh); err != nil {
		return nil, err // paused until the lane or the consumer stopped: redelivered
	}
	first := b.Deliveries[0]
	l := &lane{ctx: ctx, stop: b.Stop, origin: first.Origin, topic: first.Topic, part: first.Partition}
	var (
		todo    []*item
		fails   []failure
		ignored int64
	)
	for _, d := range b.Deliveries {
		m := &Message{
			Message:       d.Message,
			OriginalTopic: d.Origin,
			Partition:     d.Partition,
			Offset:        d.Offset,
			Attempt:       max(d.Attempt, 1),
			FirstFailure:  d.FirstFailure,
		}
		it := &item{d: d, msg: m}
		// Filter on the tipus header before decoding, but only on one that
		// is unambiguous; a header that disagrees with the envelope is a
		// permanent failure, never a silent skip.
		var th contract.TypeHeader
		if d.Types != nil {
			th = *d.Types
		} else {
			for _, h := range m.Headers {
				if h.Key == contract.HeaderType {
					th.Add(h.Value)
				}
			}
		}
		if t, ok := th.Filter(); ok && !c.handles(t) {
			ignored++
			continue
		}
		env, err := c.decode(d)
		if err == nil && (env == nil || (env.ID == "" && !c.cfg.NoInbox)) {
			err = errNoID
		}
		if errors.Is(err, outcome.ErrIgnore) {
			ignored++
			continue
		}
		if err == nil {
			if terr := th.Check(env.Type); terr != nil {
				m.Envelope = env // the dead letter's log names its id
				err = outcome.Permanent(terr)
			}
		}
		if err != nil {
			// A message that does not decode never will: dead-letter it now
			// and keep the lane moving.
			fails = append(fails, failure{it: it, kind: outcome.KindPermanent, err: err})
			continue
		}
		if !c.handles(env.Type) {
			ignored++
			continue
		}
		m.Envelope = env
		m.idempotencyKey = idempotencyKey(env)
		todo = append(todo, it)
	}
	c.count(l.origin, resIgnored, ignored)
	if c.order != nil {
		var err error
		if fails, err = c.handleOrdered(l, todo, fails); err != nil {
			return nil, err
		}
		return c.decide(fails), nil
	}
	for len(todo) > 0 {
		// A transaction never holds the same id twice (an event published
		// twice back to back): the second copy goes to the next transaction,
		// where it is a duplicate.
		n := len(todo)
		if !c.cfg.NoInbox {
			seen := make(map[string]bool, len(todo))
			for i, it := range todo {
				if seen[it.msg.idempotencyKey] {
					n = i
					break
				}
				seen[it.msg.idempotencyKey] = true
			}
		}
		var err error
		if fails, err = c.runOptimistic(l, todo[:n], fails); err != nil {
			return nil, err
		}
		todo = todo[n:]
	}
	return c.decide(fails), nil
}

// errNoID: a Decode hook returned no envelope or one without an id, which
// cannot be made idempotent.
var errNoID = errors.New("envelope: id_esdeveniment: empty (from the Decode hook)")

// idempotencyKey is what an idempotent consumer records for env: its
// "correlacio" member when that is a non-empty string (the shared id of a
// dual-published pair; see Message.IdempotencyKey), else its id_esdeveniment.
func idempotencyKey(env *envelope.Envelope) string {
	return contract.IdempotencyKey(env.ID, env.Extra[contract.HeaderCorrelator])
}

func (c *Consumer) handles(tipus string) bool { return c.types == nil || c.types[tipus] }

// runOptimistic runs msgs in as few transactions as it can. It tries them all
// in one; if message k fails, it rolls back and commits the first k again on
// their own, then runs message k alone (its failure is then its own), then
// goes on with the rest. So a failing message never takes its neighbours'
// keys or effects with it, and the messages still take effect in offset
// order. With HandleBatchOutcomes the handler names the refused messages
// itself, and the rest commit in the same transaction (tryTx). A deadlock or
// serialisation failure anywhere in a transaction reruns the same
// transaction in place, spending no attempt (conflict). Infrastructure
// errors (no connection, COMMIT with unknown outcome) retry the same
// transaction after a backoff: the keys make a repeat safe.
func (c *Consumer) runOptimistic(l *lane, msgs []*item, fails []failure) ([]failure, error) {
	var errs, conflicts int // consecutive infrastructure errors and conflicts: the backoffs' counts
	whole := c.cfg.HandleBatch != nil || c.cfg.HandleBatchOutcomes != nil
	for len(msgs) > 0 {
		end := len(msgs)
		for {
			failAt, ferr, refused, err := c.tryTx(l.ctx, msgs[:end], whole)
			if failAt < 0 && err == nil {
				// Committed: counted (and observed) whatever happens next,
				// a crash or a stop that raced the COMMIT included, so
				// Stats.Processed is the effects committed.
				herr := c.committed(l, msgs[:end], refused)
				if cerr := c.Err(); cerr != nil {
					return fails, cerr
				}
				if herr != nil {
					return fails, herr
				}
				msgs = msgs[end:]
				for _, f := range refused {
					if c.order == nil || len(f.it.msg.Key) == 0 {
						fails = append(fails, f)
						continue
					}
					// Per-key order: a refused message blocks its key as a
					// failed one does (overtakes kept its key out of the
					// rest of this transaction).
					var out []failure
					var err error
					if msgs, out, err = c.blockKey(l, f, msgs); err != nil {
						return fails, err
					}
					fails = append(fails, out...)
				}
				break
			}
			if cerr := c.Err(); cerr != nil {
				return fails, cerr
			}
			if code := pgerr.Conflict(err, ferr); code != "" && l.ctx.Err() == nil {
				if !c.conflict(l, code, cmp.Or(err, ferr), &conflicts) {
					return fails, fmt.Errorf("consumer: batch abandoned after a conflict: %w", cmp.Or(err, ferr))
				}
				continue
			}
			if errors.Is(err, errBatchFailed) {
				c.log.Warn("consumer: batch handler failed; running the batch one message at a time",
					"topic", l.topic, "partition", l.part, "messages", end, "err", err)
				whole = false // find the culprit one message at a time
				continue
			}
			if err != nil {
				c.log.Warn("consumer: transaction", "topic", l.topic, "partition", l.part, "err", err)
				if !c.pause(l, &errs) {
					return fails, fmt.Errorf("consumer: batch abandoned: %w", err)
				}
				continue
			}
			if failAt == 0 {
				kind, delay := outcome.Classify(ferr, c.cfg.Classifier)
				f := failure{it: msgs[0], kind: kind, wait: delay, err: ferr}
				msgs = msgs[1:]
				if c.order != nil && len(f.it.msg.Key) > 0 {
					// Per-key order: the key blocks behind f before its copy
					// is made; its later messages here are parked.
					var out []failure
					var err error
					if msgs, out, err = c.blockKey(l, f, msgs); err != nil {
						return fails, err
					}
					fails = append(fails, out...)
					break
				}
				fails = append(fails, f)
				break
			}
			end = failAt
		}
	}
	return fails, nil
}

// Bounds of the in-place rerun of a transaction after a conflict: the wait
// starts at conflictBackoffMin, doubles at each conflict of the same batch up
// to conflictBackoffMax, and is jittered down by up to a half, so the two
// sides of a deadlock do not collide again in step.
const (
	conflictBackoffMin = 2 * time.Millisecond
	conflictBackoffMax = time.Second
)

// conflict logs and counts a conflict of partition p with SQLSTATE code and
// waits before the rerun. It reports false when the partition is stopping or
// the consumer is shutting down or crashing: the batch is then abandoned
// (rolled back; its offsets stay uncommitted and it is redelivered).
func (c *Consumer) conflict(l *lane, code string, err error, conflicts *int) bool {
	c.counts[resConflict].Add(1)
	c.m.conflicts.WithLabelValues(l.origin, code).Inc()
	*conflicts++
	d := pause.Backoff(conflictBackoffMin, conflictBackoffMax, *conflicts)
	c.log.Warn("consumer: transaction conflict; rerunning it in place", "topic", l.topic, "partition", l.part,
		"sqlstate", code, "wait", d, "err", err)
	return c.sleep(l, d)
}

// Bounds of the in-place retry of a batch after an infrastructure error: 50 ms
// doubling to 5 s, jittered (pause.Backoff), so the lanes that an outage
// stopped together do not retry in lockstep.
const (
	retryBackoffMin = 50 * time.Millisecond
	retryBackoffMax = 5 * time.Second
)

// pause counts one more consecutive failure in *fails and waits its backoff
// unless the lane stops or the consumer stops or crashes first; it reports
// whether to carry on.
func (c *Consumer) pause(l *lane, fails *int) bool {
	*fails++
	return c.sleep(l, pause.Backoff(retryBackoffMin, retryBackoffMax, *fails))
}

// sleep waits d unless the lane stops or the consumer stops or crashes
// first; it reports whether to carry on.
func (c *Consumer) sleep(l *lane, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return l.ctx.Err() == nil && c.Err() == nil
	case <-l.stop:
		return false
	case <-l.ctx.Done():
		return false
	case <-c.crashCh:
		return false
	}
}

// committed counts a committed transaction and runs the AfterCommit hook on
// the messages it applied (refused ones are failures, counted by route).
func (c *Consumer) committed(l *lane, msgs []*item, refused []failure) error {
	var dups int64
	for _, it := range msgs {
		if it.dup {
			dups++
		}
	}
	applied := msgs
	if len(refused) > 0 {
		out := make(map[*item]bool, len(refused))
		for _, f := range refused {
			out[f.it] = true
		}
		applied = make([]*item, 0, len(msgs)-len(refused))
		for _, it := range msgs {
			if !out[it] {
				applied = append(applied, it)
			}
		}
	}
	c.count(l.origin, resProcessed, int64(len(applied))-dups)
	c.count(l.origin, resDuplicate, dups)
	if c.cfg.OnCommit != nil || c.faults.AfterCommit != nil {
		var fresh []*Message
		for _, it := range applied {
			if !it.dup {
				fresh = append(fresh, it.msg)
			}
		}
		if c.cfg.OnCommit != nil && len(fresh) > 0 {
			c.cfg.OnCommit(l.ctx, fresh)
		}
		if h := c.faults.AfterCommit; h != nil && c.Err() == nil {
			return c.hook(h(l.ctx, messages(applied)))
		}
	}
	return nil
}

func messages(items []*item) []*Message {
	out := make([]*Message, len(items))
	for i, it := range items {
		out[i] = it.msg
	}
	return out
}

// commitTimeout bounds a COMMIT, which a stop or a crash does not
// interrupt (tryTx).
const commitTimeout = 10 * time.Second

// tryTx runs msgs in one transaction: their keys in one statement, then the
// handler of each new one (or, with whole, HandleBatch or HandleBatchOutcomes
// once for all of them: an error wrapping errBatchFailed if that fails). It
// returns failAt = -1 when it committed, with the messages HandleBatchOutcomes
// refused (their keys deleted in the transaction); else failAt = k with the
// error of message k, after rolling everything back (failAt may also be a
// split point when COMMIT itself was refused). err is an infrastructure error:
// nothing is known about any message of msgs. A deadlock or serialisation
// failure comes back in ferr or err, unchanged, for runOptimistic to see.
func (c *Consumer) tryTx(ctx context.Context, msgs []*item, whole bool) (failAt int, ferr error, refused []failure, err error) {
	select { // at most Concurrency transactions at once
	case c.sem <- struct{}{}:
		defer func() { <-c.sem }()
	case <-ctx.Done():
		return 0, nil, nil, ctx.Err()
	}
	tx, fresh, keysErr, err := c.begin(ctx, msgs)
	if tx != nil {
		defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	}
	if err != nil {
		return 0, nil, nil, err
	}
	if keysErr != nil {
		if pgerr.DataRefused(keysErr) {
			// A key the database refuses as data (class 22 data exception,
			// 54 limit exceeded) fails again on every try: find whose, as
			// for a refused COMMIT, so it reaches the DLQ.
			if len(msgs) == 1 {
				return 0, outcome.Permanent(fmt.Errorf("idempotency key refused: %w", keysErr)), nil, nil
			}
			return len(msgs) / 2, keysErr, nil, nil
		}
		return 0, nil, nil, keysErr
	}
	var todo []*item
	for _, it := range msgs {
		it.dup = fresh != nil && !fresh[it.msg.idempotencyKey]
		if !it.dup {
			todo = append(todo, it)
		}
	}
	switch {
	case len(todo) == 0:
	case whole && c.cfg.HandleBatchOutcomes != nil:
		refused, err = c.callOutcomes(ctx, tx, todo)
		if err == nil && c.order != nil && overtakes(todo, refused) {
			err = errors.New("per-key order: a message was refused and a later one of its key accepted")
		}
		if err != nil {
			if end := txEnding(ctx, tx, "batch handler", err); end != nil {
				return 0, nil, nil, end
			}
			return 0, nil, nil, fmt.Errorf("%w: %w", errBatchFailed, err)
		}
	case whole && len(todo) > 1:
		if herr := c.callBatch(ctx, tx, messages(todo)); herr != nil {
			if end := txEnding(ctx, tx, "batch handler", herr); end != nil {
				return 0, nil, nil, end
			}
			return 0, nil, nil, fmt.Errorf("%w: %w", errBatchFailed, herr)
		}
	default:
		for k, it := range msgs {
			if it.dup {
				continue
			}
			if c.outcomesOnly() {
				// A refusal keeps what the handler wrote for the message (a
				// compensation event, say), as it does in a batch; so the
				// refused message commits alone, without those after it.
				r, herr := c.callOutcomes(ctx, tx, []*item{it})
				switch {
				case herr != nil:
					if end := txEnding(ctx, tx, "handler", herr); end != nil {
						return 0, nil, nil, end
					}
					return k, herr, nil, nil
				case len(r) > 0 && len(msgs) > 1:
					return max(k, 1), nil, nil, nil
				}
				refused = append(refused, r...)
				continue
			}
			if herr := c.call(ctx, tx, it.msg); herr != nil {
				if ctx.Err() != nil || tx.Conn().IsClosed() {
					return 0, nil, nil, fmt.Errorf("handler lost its connection: %w", herr)
				}
				return k, herr, nil, nil
			}
		}
	}
	if h := c.faults.BeforeTxCommit; h != nil {
		if err := c.hook(h(ctx, tx, messages(msgs))); err != nil {
			return 0, nil, nil, err
		}
	}
	// The COMMIT is not interrupted by a stop or a crash: interrupted, its
	// outcome would be unknown (the server may commit after the client gave
	// up) and a committed batch could go uncounted. commitTimeout bounds it.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if err := tx.Commit(cctx); err != nil {
		// Refused, e.g. by a deferred constraint, or the transaction was
		// already aborted by a statement whose error a handler swallowed:
		// find whose.
		if pgerr.Server(err) || errors.Is(err, pgx.ErrTxCommitRollback) {
			if len(msgs) == 1 {
				return 0, err, nil, nil
			}
			return len(msgs) / 2, err, nil, nil
		}
		return 0, nil, nil, fmt.Errorf("commit: %w", err)
	}
	return -1, nil, refused, nil
}

// outcomesOnly reports whether HandleBatchOutcomes is the only handler: a
// message run on its own then goes through it too (callOutcomes), so that
// its refusal has the same meaning as in a batch.
func (c *Consumer) outcomesOnly() bool {
	return c.cfg.Handle == nil && c.cfg.HandleBatchOutcomes != nil
}

// callOutcomes runs HandleBatchOutcomes on todo and, in tx, deletes the keys
// of the messages it refused; it returns those as failures. An error fails
// the whole batch (a panic, a result of the wrong length, the handler's own
// error, or the key deletion's).
func (c *Consumer) callOutcomes(ctx context.Context, tx pgx.Tx, todo []*item) (refused []failure, err error) {
	outcomes, err := c.callBatchOutcomes(ctx, tx, messages(todo))
	if err != nil {
		return nil, err
	}
	if outcomes == nil {
		return nil, nil
	}
	if len(outcomes) != len(todo) {
		return nil, fmt.Errorf("batch handler returned %d outcomes for %d messages", len(outcomes), len(todo))
	}
	var keys []string
	for i, oerr := range outcomes {
		if oerr == nil {
			continue
		}
		kind, delay := outcome.Classify(oerr, c.cfg.Classifier)
		refused = append(refused, failure{it: todo[i], kind: kind, wait: delay, err: oerr})
		keys = append(keys, todo[i].msg.idempotencyKey)
	}
	if len(keys) > 0 && !c.cfg.NoInbox {
		if _, err := tx.Exec(ctx, c.deleteKeys, keys, c.cfg.Name); err != nil {
			return nil, fmt.Errorf("delete the keys of refused messages: %w", err)
		}
	}
	return refused, nil
}

// overtakes reports whether a refused message has a later message of its
// key in todo (per-key order: the later one must wait behind it, so the
// batch runs one message at a time instead).
func overtakes(todo []*item, refused []failure) bool {
	if len(refused) == 0 {
		return false
	}
	out := map[*item]bool{}
	for _, f := range refused {
		out[f.it] = true
	}
	blocked := map[string]bool{}
	for _, it := range todo {
		k := string(it.msg.Key)
		switch {
		case k == "":
		case blocked[k]: // a later message, accepted or refused, of a refused one's key
			return true
		case out[it]:
			blocked[k] = true
		}
	}
	return false
}

// begin starts the transaction of msgs on a connection of the pool and,
// with the inbox, records their keys in it; BEGIN and the keys' INSERT reach
// the server together, in one round trip (pgx.Batch.BeginTx). It returns the
// transaction, which the caller rolls back (a no-op once committed, or when
// none could be started: pgx then returns it closed), the keys that were new
// (nil without the inbox), the INSERT's error in keysErr, and in err an error
// before it: no connection, or BEGIN failed.
func (c *Consumer) begin(ctx context.Context, msgs []*item) (tx pgx.Tx, fresh map[string]bool, keysErr, err error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	if !c.cfg.NoInbox {
		b.Queue(c.insertKeys, sortedKeys(msgs), c.cfg.Name)
	}
	br := c.cfg.Pool.SendBatch(ctx, b)
	tx = br.Tx()
	if _, berr := br.Exec(); berr != nil {
		_ = br.Close() // the same error
		if !c.cfg.NoInbox && pgerr.DataRefused(berr) {
			// BEGIN itself is never refused as data: in the simple protocol
			// the batch is one query string, which the server checks whole
			// (its encoding) before it runs any statement, so a key it
			// refuses fails the batch at BEGIN's result.
			return tx, nil, fmt.Errorf("record keys: %w", berr), nil
		}
		return tx, nil, nil, fmt.Errorf("begin: %w", berr)
	}
	if !c.cfg.NoInbox {
		rows, qerr := br.Query()
		if qerr == nil {
			fresh, qerr = collectFresh(rows, len(msgs))
		}
		if qerr != nil {
			_ = br.Close() // the same error
			return tx, nil, fmt.Errorf("record keys: %w", qerr), nil
		}
	}
	if cerr := br.Close(); cerr != nil {
		return tx, nil, nil, fmt.Errorf("begin: %w", cerr)
	}
	return tx, fresh, nil, nil
}

// sortedKeys returns the idempotency keys of msgs in one lock order for
// every transaction (bulkInsertSQL).
func sortedKeys(msgs []*item) []string {
	ids := make([]string, len(msgs))
	for i, it := range msgs {
		ids[i] = it.msg.idempotencyKey
	}
	slices.Sort(ids)
	return ids
}

// recordKeys inserts the keys of msgs and returns the ids that were new.
func (c *Consumer) recordKeys(ctx context.Context, tx pgx.Tx, msgs []*item) (map[string]bool, error) {
	rows, err := tx.Query(ctx, c.insertKeys, sortedKeys(msgs), c.cfg.Name)
	if err != nil {
		return nil, fmt.Errorf("record keys: %w", err)
	}
	fresh, err := collectFresh(rows, len(msgs))
	if err != nil {
		return nil, fmt.Errorf("record keys: %w", err)
	}
	return fresh, nil
}

// collectFresh reads the ids the keys' INSERT returned: those that were new.
func collectFresh(rows pgx.Rows, n int) (map[string]bool, error) {
	fresh := make(map[string]bool, n)
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, err
		}
		fresh[id] = true
	}
	return fresh, rows.Err()
}

// errBatchFailed: HandleBatch or HandleBatchOutcomes failed; the batch runs
// again one message at a time.
var errBatchFailed = errors.New("consumer: batch handler failed")

// callBatch runs HandleBatch; a panic is an error like any other (the
// messages then run one by one with Handle, which decides their fate).
func (c *Consumer) callBatch(ctx context.Context, tx pgx.Tx, msgs []*Message) (err error) {
	ctx, end := c.startBatchSpans(ctx, msgs)
	defer func() { end(nil, err) }() // after the recover below
	defer func() {
		if r := recover(); r != nil {
			err = &PanicError{Value: r, Stack: debug.Stack()}
			c.log.Warn("consumer: batch handler panic", "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
		}
	}()
	return c.cfg.HandleBatch(ctx, tx, msgs)
}

// callBatchOutcomes runs HandleBatchOutcomes; a panic fails the whole batch,
// as in callBatch.
func (c *Consumer) callBatchOutcomes(ctx context.Context, tx pgx.Tx, msgs []*Message) (outcomes []error, err error) {
	ctx, end := c.startBatchSpans(ctx, msgs)
	defer func() { end(outcomes, err) }() // after the recover below
	defer func() {
		if r := recover(); r != nil {
			outcomes, err = nil, &PanicError{Value: r, Stack: debug.Stack()}
			c.log.Warn("consumer: batch handler panic", "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
		}
	}()
	return c.cfg.HandleBatchOutcomes(ctx, tx, msgs)
}

// decode runs the Decode hook. A panic (in an upcaster, say) is a permanent
// *PanicError: the same bytes would panic at every delivery, so the record
// goes to the DLQ at once instead of killing the process again and again.
func (c *Consumer) decode(d *transport.Delivery) (env *envelope.Envelope, err error) {
	defer func() {
		if v := recover(); v != nil {
			pe := &PanicError{Value: v, Stack: debug.Stack()}
			c.log.Error("consumer: decode panic", "topic", d.Topic, "partition", d.Partition, "offset", d.Offset,
				"panic", fmt.Sprint(v), "stack", string(pe.Stack))
			env, err = nil, outcome.Permanent(fmt.Errorf("decode: %w", pe))
		}
	}()
	return c.cfg.Decode(d.Value)
}

// call runs the handler, turning a panic into a transient *PanicError.
func (c *Consumer) call(ctx context.Context, tx pgx.Tx, m *Message) (err error) {
	ctx, span := c.startSpan(ctx, m)
	defer func() { tracing.End(span, err) }() // after the recover below
	defer func() {
		if r := recover(); r != nil {
			pe := &PanicError{Value: r, Stack: debug.Stack()}
			c.log.Error("consumer: handler panic", "id", m.Envelope.ID, "topic", m.Topic,
				"partition", m.Partition, "offset", m.Offset, "panic", fmt.Sprint(r), "stack", string(pe.Stack))
			err = outcome.Transient(pe)
		}
	}()
	if c.cfg.Handle != nil {
		return c.cfg.Handle(ctx, tx, m)
	}
	// Only HandleBatchOutcomes: a batch of one.
	outcomes, err := c.cfg.HandleBatchOutcomes(ctx, tx, []*Message{m})
	switch {
	case err != nil:
		return err
	case len(outcomes) == 0:
		return nil
	case len(outcomes) != 1:
		return fmt.Errorf("batch handler returned %d outcomes for 1 message", len(outcomes))
	}
	return outcomes[0]
}

// txEnding is the error that ends tx after a handler failed with herr: its
// connection is gone (or ctx is done), or herr is a conflict (SQLSTATE 40)
// that reruns the transaction. Nil: herr is the handler's own failure and
// tx can go on (after its savepoint, if any, is rolled back).
func txEnding(ctx context.Context, tx pgx.Tx, who string, herr error) error {
	if ctx.Err() != nil || tx.Conn().IsClosed() {
		return fmt.Errorf("%s lost its connection: %w", who, herr)
	}
	if pgerr.Conflict(herr) != "" {
		return herr
	}
	return nil
}
