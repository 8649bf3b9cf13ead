package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay/internal/relaycore"
	"github.com/km0/km0/transport"
)

// cycleResult counts one claim-publish-mark cycle.
type cycleResult struct {
	limit     int // the claim's size
	claimed   int // rows the claim returned
	published int // rows marked published
	parked    int // rows parked
}

// crashError carries a hook's error out of the worker: the relay stops.
type crashError struct{ err error }

func (e *crashError) Error() string { return e.err.Error() }
func (e *crashError) Unwrap() error { return e.err }

func asCrash(err error, target **crashError) bool { return errors.As(err, target) }

// parking is a row to park, with its reason.
type parking struct {
	row    int
	reason string
}

// cycle claims a batch from the owned shards, publishes it and marks it, all
// in one transaction of the worker's session:
//
//	BEGIN; SELECT ... FOR UPDATE SKIP LOCKED     (one round trip)
//	for each chunk of the batch, in order:
//	    publish its records, wait for every confirmation;
//	    meanwhile UPDATE publicat_en of the previous, confirmed chunk
//	UPDATE the last chunk; INSERT parked; COMMIT  (one round trip)
//
// A row's publicat_en is set only after its records were confirmed, and
// nothing commits before every record of the batch was. A broker failure
// rolls back (rows stay pending, session kept). A database failure closes
// the session. A hook error closes the session without committing and comes
// back as a *crashError.
func (w *worker) cycle(ctx context.Context) (res cycleResult, err error) {
	res.limit = w.claimSize()
	if len(w.owned) == 0 {
		return res, nil
	}
	rows, tids, err := w.claim(ctx, res.limit)
	if err != nil {
		w.drop()
		return res, err
	}
	res.claimed = len(rows)
	w.adapt(res.limit, res.claimed)
	if h := probes(ctx).Claimed; h != nil && len(rows) > 0 {
		h(w.idx, res.limit, len(rows))
	}
	if len(rows) == 0 {
		if err := w.exec(ctx, "COMMIT"); err != nil {
			w.drop()
			return res, err
		}
		return res, nil
	}
	b := &batch{rows: rows, state: make([]rowState, len(rows))}
	var toMark []pgtype.TID // confirmed rows whose UPDATE is not sent yet
	chunk := chunkRows(res.limit)
	for start := 0; start < len(rows); start += chunk {
		end := min(start+chunk, len(rows))
		msgs, owner := w.build(b, start, end)
		pubErr, updErr := w.publishWhileMarking(ctx, msgs, toMark)
		if updErr != nil {
			w.drop()
			return res, updErr
		}
		toMark = toMark[:0]
		var rej *transport.RejectedError
		switch {
		case pubErr == nil:
		case errors.As(pubErr, &rej):
			w.rejected(b, msgs, owner, rej)
		default:
			if err := w.exec(ctx, "ROLLBACK"); err != nil {
				w.drop()
			}
			return res, fmt.Errorf("relay: publish %d records: %w", len(msgs), pubErr)
		}
		for i := start; i < end; i++ {
			if b.state[i] == sent {
				toMark = append(toMark, tids[i])
				res.published++
			}
		}
	}
	if h := probes(ctx).AfterPublish; h != nil {
		if err := h(res.published); err != nil {
			// The process "dies" here: after the broker confirmed, before
			// the mark commits. Closing the session rolls the claim back.
			w.drop()
			return res, &crashError{err}
		}
	}
	if err := w.mark(ctx, rows, toMark, b.parked); err != nil {
		w.drop()
		return res, err
	}
	res.parked = len(b.parked)
	w.r.m.published.Add(float64(res.published))
	if len(b.parked) > 0 {
		w.r.m.parked.Add(float64(len(b.parked)))
		for _, p := range b.parked {
			w.r.cfg.Logger.Error("relay: row parked: its aggregate waits until it is released",
				"relay", w.r.q.payload, "id", rows[p.row].ID, "agregat_id", rows[p.row].AggregateID,
				"tipus", rows[p.row].Type, "motiu", p.reason)
		}
	}
	return res, nil
}

// chunkRows is the size of the chunks a batch of a claim of limit rows is
// published in: a quarter of limit, at least 100 rows (smaller batches go in
// one piece).
func chunkRows(limit int) int { return max(100, limit/4) }

// publishWhileMarking publishes msgs and, at the same time, sends the UPDATE
// of the rows in toMark (already confirmed) on the worker's session.
func (w *worker) publishWhileMarking(ctx context.Context, msgs []*transport.Message, toMark []pgtype.TID) (pubErr, updErr error) {
	if len(toMark) == 0 {
		return w.publish(ctx, msgs), nil
	}
	done := make(chan error, 1)
	go func() { done <- w.publish(ctx, msgs) }()
	if _, err := w.conn.Exec(ctx, w.r.q.mark, toMark); err != nil {
		updErr = fmt.Errorf("relay: mark: %w", err)
	}
	return <-done, updErr
}

func (w *worker) exec(ctx context.Context, sql string) error {
	_, err := w.conn.Exec(ctx, sql)
	return err
}

// claim begins the transaction and claims up to limit rows of the owned
// shards, in creat_en order, in one round trip (two when pooled: the shards
// are locked for the transaction first, see claimPooled).
func (w *worker) claim(ctx context.Context, limit int) ([]outbox.Row, []pgtype.TID, error) {
	b := &pgx.Batch{}
	shards := w.owned
	if w.r.pooled.Load() {
		var err error
		if shards, err = w.claimPooled(ctx); err != nil {
			return nil, nil, err
		}
		if len(shards) == 0 {
			return nil, nil, nil // the transaction is open: cycle commits it
		}
	} else {
		b.Queue("BEGIN")
		w.queueLocal(b)
	}
	if len(shards) == ShardCount {
		b.Queue(w.r.q.claimAll, limit)
	} else {
		b.Queue(w.r.q.claim, shards, limit)
	}
	br := w.conn.SendBatch(ctx, b)
	defer br.Close()
	for range b.Len() - 1 {
		if _, err := br.Exec(); err != nil {
			return nil, nil, fmt.Errorf("relay: begin: %w", err)
		}
	}
	q, err := br.Query()
	if err != nil {
		return nil, nil, fmt.Errorf("relay: claim: %w", err)
	}
	out := make([]outbox.Row, 0, min(limit, 256))
	tids := make([]pgtype.TID, 0, min(limit, 256))
	for q.Next() {
		var r outbox.Row
		var id pgtype.UUID // pgx's binary fast path (uuid.UUID goes through text)
		var tid pgtype.TID
		var headers []byte // capcaleres: nil when NULL, decoded only when set
		if err := q.Scan(&id, &r.Aggregate, &r.AggregateID, &r.Type, &r.Version, &r.Payload, &r.CreatedAt, &tid, &headers); err != nil {
			q.Close()
			return nil, nil, fmt.Errorf("relay: claim: %w", err)
		}
		r.ID = id.Bytes
		if headers != nil {
			var herr error
			if r.Headers, herr = outbox.DecodeHeaders(headers); herr != nil {
				// Bad metadata never holds back its event: it goes out
				// with the headers that passed.
				w.r.cfg.Logger.Warn("relay: capcaleres dropped in part", "relay", w.r.q.payload,
					"id", r.ID, "tipus", r.Type, "error", herr)
			}
		}
		out = append(out, r)
		tids = append(tids, tid)
	}
	if err := q.Err(); err != nil {
		return nil, nil, fmt.Errorf("relay: claim: %w", err)
	}
	return out, tids, br.Close()
}

// rowState is what happened to a claimed row in this cycle.
type rowState uint8

const (
	unsent rowState = iota // not handed to the broker (yet)
	sent                   // every record confirmed
	parked                 // refused for good: parked
	held                   // behind a parked row of its aggregate: stays pending
)

// batch is the claimed rows and what happened to each.
type batch struct {
	rows    []outbox.Row
	state   []rowState
	parked  []parking
	blocked map[string]bool // aggregates with a parked row in this batch
}

func (b *batch) park(row int, reason string) {
	b.state[row] = parked
	b.parked = append(b.parked, parking{row: row, reason: reason})
	if b.blocked == nil {
		b.blocked = map[string]bool{}
	}
	b.blocked[b.rows[row].AggregateID] = true
}

// build encodes the records of rows [start, end) of b; owner[i] is the row of
// msgs[i]. A row whose envelope cannot be built or is over MaxRecordBytes is
// parked unsent; a row of an aggregate with a parked row earlier in the batch
// is held back (it stays pending behind it). The rows returned are marked
// sent: the caller corrects those the broker refuses.
func (w *worker) build(b *batch, start, end int) (msgs []*transport.Message, owner []int) {
	msgs = make([]*transport.Message, 0, end-start)
	owner = make([]int, 0, end-start)
	for i := start; i < end; i++ {
		row := &b.rows[i]
		if b.blocked[row.AggregateID] {
			b.state[i] = held
			continue
		}
		recs, reason := w.records(row)
		if reason != "" {
			b.park(i, reason)
			continue
		}
		b.state[i] = sent
		for _, m := range recs {
			msgs = append(msgs, m)
			owner = append(owner, i)
		}
	}
	return msgs, owner
}

// records returns the records of one row, or the reason to park it.
func (w *worker) records(row *outbox.Row) ([]*transport.Message, string) {
	return w.r.enc.Records(row)
}

// publish hands msgs to the broker and waits for every confirmation, at most
// PublishTimeout.
func (w *worker) publish(ctx context.Context, msgs []*transport.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, w.r.cfg.PublishTimeout)
	defer cancel()
	// Each record carries its own row's trace (capcaleres), never the
	// relay's: publishers inject the trace of their ctx, so hide any.
	ctx = trace.ContextWithSpanContext(ctx, trace.SpanContext{})
	return w.r.cfg.Publisher.Publish(ctx, msgs)
}

// rejected parks the rows with a record the broker refused for good; the
// rows of their aggregates in later chunks are then held back. Their other
// records, and the later rows of their aggregates in the same chunk, were
// confirmed (the broker has them) and are marked: a record refused by the
// broker itself can be overtaken within its chunk. MaxRecordBytes, and a
// publisher's transport.Checker, both consulted before sending, avoid that
// for every refusal they can foresee (oversized rows; AMQP short strings).
func (w *worker) rejected(b *batch, msgs []*transport.Message, owner []int, rej *transport.RejectedError) {
	for k, idx := range rej.Index {
		if idx < 0 || idx >= len(msgs) || b.state[owner[idx]] == parked {
			continue
		}
		row := owner[idx]
		reason := "unknown"
		if k < len(rej.Errs) && rej.Errs[k] != nil {
			reason = rej.Errs[k].Error()
		}
		b.park(row, clip("broker: "+reason))
		for j, later := range owner {
			if later > row && (j == 0 || owner[j-1] != later) && b.rows[later].AggregateID == b.rows[row].AggregateID {
				w.r.cfg.Logger.Warn("relay: a later event of an aggregate went out in the same chunk as its parked row",
					"relay", w.r.q.payload, "parked", b.rows[row].ID, "later", b.rows[later].ID)
			}
		}
	}
}

// mark sets publicat_en on done, parks parked and commits, in one round trip.
func (w *worker) mark(ctx context.Context, rows []outbox.Row, done []pgtype.TID, parked []parking) error {
	b := &pgx.Batch{}
	if len(done) > 0 {
		b.Queue(w.r.q.mark, done)
	}
	if len(parked) > 0 {
		ids, aggs, reasons := make([]uuid.UUID, len(parked)), make([]string, len(parked)), make([]string, len(parked))
		for i, p := range parked {
			ids[i], aggs[i], reasons[i] = rows[p.row].ID, rows[p.row].AggregateID, p.reason
		}
		b.Queue(w.r.q.park, ids, aggs, reasons)
	}
	b.Queue("COMMIT")
	br := w.conn.SendBatch(ctx, b)
	defer br.Close()
	for range b.Len() - 1 {
		if _, err := br.Exec(); err != nil {
			return fmt.Errorf("relay: mark: %w", err)
		}
	}
	tag, err := br.Exec()
	if err != nil {
		return fmt.Errorf("relay: commit: %w", err)
	}
	if tag.String() != "COMMIT" {
		return fmt.Errorf("relay: commit: the server answered %q", tag.String())
	}
	return br.Close()
}

// clip makes s storable as motiu (relaycore.Clip).
func clip(s string) string { return relaycore.Clip(s) }
