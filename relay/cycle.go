package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport"
)

// cycleResult counts one claim-publish-mark cycle.
type cycleResult struct {
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
//	BEGIN; SELECT ... FOR UPDATE SKIP LOCKED   (one round trip)
//	publish every record, wait for every confirmation
//	UPDATE publicat_en; INSERT parked; COMMIT  (one round trip)
//
// A broker failure rolls back (rows stay pending, session kept). A database
// failure closes the session. A hook error closes the session without marking
// and comes back as a *crashError.
func (w *worker) cycle(ctx context.Context) (res cycleResult, err error) {
	if len(w.owned) == 0 {
		return res, nil
	}
	rows, tids, err := w.claim(ctx)
	if err != nil {
		w.drop()
		return res, err
	}
	res.claimed = len(rows)
	if len(rows) == 0 {
		if err := w.exec(ctx, "COMMIT"); err != nil {
			w.drop()
			return res, err
		}
		return res, nil
	}
	msgs, owner, parked, held := w.build(rows)
	pubErr := w.publish(ctx, msgs)
	var rej *transport.RejectedError
	switch {
	case pubErr == nil:
	case errors.As(pubErr, &rej):
		parked = w.rejected(rows, msgs, owner, rej, parked)
	default:
		if err := w.exec(ctx, "ROLLBACK"); err != nil {
			w.drop()
		}
		return res, fmt.Errorf("relay: publish %d records: %w", len(msgs), pubErr)
	}
	done := confirmedRows(tids, parked, held)
	if h := w.r.cfg.Hooks.AfterPublish; h != nil {
		if err := h(len(done)); err != nil {
			// The process "dies" here: after the broker confirmed, before
			// the mark. Closing the session rolls the claim back.
			w.drop()
			return res, &crashError{err}
		}
	}
	if err := w.mark(ctx, rows, done, parked); err != nil {
		w.drop()
		return res, err
	}
	res.published, res.parked = len(done), len(parked)
	w.r.m.published.Add(float64(len(done)))
	if len(parked) > 0 {
		w.r.m.parked.Add(float64(len(parked)))
		for _, p := range parked {
			w.r.cfg.Logger.Error("relay: row parked: its aggregate waits until it is released",
				"relay", w.r.q.payload, "id", rows[p.row].ID, "agregat_id", rows[p.row].AggregateID,
				"tipus", rows[p.row].Type, "motiu", p.reason)
		}
	}
	return res, nil
}

func (w *worker) exec(ctx context.Context, sql string) error {
	_, err := w.conn.Exec(ctx, sql)
	return err
}

// claim begins the transaction and claims up to BatchSize rows of the owned
// shards, in creat_en order, in one round trip.
func (w *worker) claim(ctx context.Context) ([]outbox.Row, []pgtype.TID, error) {
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	if len(w.owned) == ShardCount {
		b.Queue(w.r.q.claimAll, w.r.cfg.BatchSize)
	} else {
		b.Queue(w.r.q.claim, w.owned, w.r.cfg.BatchSize)
	}
	br := w.conn.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, nil, fmt.Errorf("relay: begin: %w", err)
	}
	q, err := br.Query()
	if err != nil {
		return nil, nil, fmt.Errorf("relay: claim: %w", err)
	}
	out := make([]outbox.Row, 0, w.r.cfg.BatchSize)
	tids := make([]pgtype.TID, 0, w.r.cfg.BatchSize)
	for q.Next() {
		var r outbox.Row
		var tid pgtype.TID
		if err := q.Scan(&r.ID, &r.Aggregate, &r.AggregateID, &r.Type, &r.Version, &r.Payload, &r.CreatedAt, &tid); err != nil {
			q.Close()
			return nil, nil, fmt.Errorf("relay: claim: %w", err)
		}
		out = append(out, r)
		tids = append(tids, tid)
	}
	if err := q.Err(); err != nil {
		return nil, nil, fmt.Errorf("relay: claim: %w", err)
	}
	return out, tids, br.Close()
}

// build encodes the records. owner[i] is the row of msgs[i]. A row whose
// envelope cannot be built or is over MaxRecordBytes is parked unsent, and
// the later rows of its aggregate in this batch are held back (held[row]):
// they stay pending behind the parked row.
func (w *worker) build(rows []outbox.Row) (msgs []*transport.Message, owner []int, parked []parking, held []bool) {
	msgs = make([]*transport.Message, 0, len(rows))
	owner = make([]int, 0, len(rows))
	held = make([]bool, len(rows))
	var blocked map[string]bool
	for i := range rows {
		row := &rows[i]
		if blocked[row.AggregateID] {
			held[i] = true
			continue
		}
		recs, reason := w.records(row)
		if reason != "" {
			parked = append(parked, parking{row: i, reason: reason})
			if blocked == nil {
				blocked = map[string]bool{}
			}
			blocked[row.AggregateID] = true
			continue
		}
		for _, m := range recs {
			msgs = append(msgs, m)
			owner = append(owner, i)
		}
	}
	return msgs, owner, parked, held
}

// records returns the records of one row, or the reason to park it.
func (w *worker) records(row *outbox.Row) ([]*transport.Message, string) {
	env := row.Envelope(w.r.cfg.Origin)
	envs := []*envelope.Envelope{env}
	if t := w.r.cfg.Transform; t != nil {
		var err error
		if envs, err = t(row, env); err != nil {
			return nil, clip("transform: " + err.Error())
		}
	}
	key := []byte(row.AggregateID)
	out := make([]*transport.Message, 0, len(envs))
	for _, e := range envs {
		value, err := e.Encode()
		if err != nil {
			return nil, clip("envelope: " + err.Error())
		}
		m := &transport.Message{Topic: w.r.cfg.Topic, Key: key, Value: value, Headers: []transport.Header{
			{Key: transport.HeaderType, Value: e.Type}, {Key: transport.HeaderEventID, Value: e.ID}}}
		if c := correlation(e); c != "" {
			m.Headers = append(m.Headers, transport.Header{Key: transport.HeaderCorrelator, Value: c})
		}
		if size := recordSize(m); size > w.r.cfg.MaxRecordBytes {
			return nil, fmt.Sprintf("record of %d bytes is over the relay's limit of %d (MaxRecordBytes)", size, w.r.cfg.MaxRecordBytes)
		}
		out = append(out, m)
	}
	return out, ""
}

// correlation is the envelope's "correlacio" member (set on both copies of a
// dual-published pair), or "".
func correlation(e *envelope.Envelope) string {
	raw, ok := e.Extra[transport.HeaderCorrelator]
	if !ok {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return ""
	}
	return s
}

func recordSize(m *transport.Message) int {
	n := len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

// publish hands msgs to the broker and waits for every confirmation, at most
// PublishTimeout.
func (w *worker) publish(ctx context.Context, msgs []*transport.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, w.r.cfg.PublishTimeout)
	defer cancel()
	return w.r.cfg.Publisher.Publish(ctx, msgs)
}

// rejected parks the rows with a record the broker refused for good. Their
// other records, and the later rows of their aggregates in this batch, were
// confirmed (the broker already has them), so they are marked published: a
// record refused by the broker itself can thus be overtaken within one batch,
// which MaxRecordBytes, checked before sending, avoids for oversized rows.
func (w *worker) rejected(rows []outbox.Row, msgs []*transport.Message, owner []int, rej *transport.RejectedError, parked []parking) []parking {
	seen := map[int]bool{}
	for k, idx := range rej.Index {
		if idx < 0 || idx >= len(msgs) || seen[owner[idx]] {
			continue
		}
		row := owner[idx]
		seen[row] = true
		var reason error = errors.New("unknown")
		if k < len(rej.Errs) {
			reason = rej.Errs[k]
		}
		parked = append(parked, parking{row: row, reason: clip("broker: " + reason.Error())})
		for j := row + 1; j < len(rows); j++ {
			if rows[j].AggregateID == rows[row].AggregateID {
				w.r.cfg.Logger.Warn("relay: a later event of an aggregate went out in the same batch as its parked row",
					"relay", w.r.q.payload, "parked", rows[row].ID, "later", rows[j].ID)
			}
		}
	}
	return parked
}

// confirmedRows lists the row versions to mark: every row that is neither
// parked nor held back.
func confirmedRows(tids []pgtype.TID, parked []parking, held []bool) []pgtype.TID {
	skip := held
	for _, p := range parked {
		skip[p.row] = true
	}
	done := make([]pgtype.TID, 0, len(tids))
	for i := range tids {
		if !skip[i] {
			done = append(done, tids[i])
		}
	}
	return done
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

func clip(s string) string {
	const n = 500
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
