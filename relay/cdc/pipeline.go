package cdc

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay/internal/relaycore"
	"github.com/km0/km0/transport"
)

// queries are the statements of one outbox table.
type queries struct {
	table   string // quoted, schema-qualified
	payload string // schema.table, the metrics label
	mark    string // $1 ids uuid[]
	markTID string // $1 ctids tid[], $2 ids uuid[] of the same rows
	visible string // $1 ids uuid[]: how many of them the session sees
	park    string // relaycore.ParkSQL
	parked  string // aggregates with a parked row
	pending string // catch-up: pending rows in commit order per aggregate
	pendOf  string // $1 agregat_ids text[]: the same, of some aggregates
	hasHdr  string // whether the outbox has the capcaleres column
	lag     string
	size    string
	wal     walQueries
}

// newQueries returns the statements of n's outbox; del makes the mark a
// DELETE, wal reads the WAL mode's parking table where the table mode reads
// the outbox (check, lag, size).
func newQueries(n migrate.Names, del, wal bool) queries {
	n = n.WithDefaults()
	table := pgx.Identifier{n.Schema, n.Outbox}.Sanitize()
	parked := pgx.Identifier{n.Schema, n.Outbox + "_aparcats"}.Sanitize()
	// The catch-up reads capcaleres when the column exists (pendingHdr),
	// NULL otherwise.
	pending := func(filter string) string {
		return "SELECT o.id, o.agregat, o.agregat_id, o.tipus, o.versio, o.carrega, o.creat_en, NULL::jsonb, o.ctid" +
			" FROM " + table + " o WHERE o.publicat_en IS NULL" + filter + " ORDER BY o.creat_en, o.id"
	}
	q := queries{
		table: table, payload: n.Schema + "." + n.Outbox,
		mark: relaycore.MarkSQL(table, del, "id = ANY($1::uuid[]) AND publicat_en IS NULL"),
		// A TID scan; the id check leaves alone a row that took the place
		// of one that moved (that one is marked by id afterwards).
		markTID: relaycore.MarkSQL(table, del, "ctid = ANY($1::tid[]) AND id = ANY($2::uuid[]) AND publicat_en IS NULL"),
		visible: "SELECT count(*) FROM " + table + " WHERE id = ANY($1::uuid[])",
		park:    relaycore.ParkSQL(n),
		parked:  "SELECT DISTINCT agregat_id FROM " + parked,
		pending: pending(""),
		pendOf:  pending(" AND o.agregat_id = ANY($1::text[])"),
		hasHdr: "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::text::regclass AND attname = '" + colHeaders +
			"' AND NOT attisdropped)",
		lag: "SELECT count(*), coalesce(extract(epoch FROM now() - min(creat_en)), 0)::float8 FROM " + table +
			" WHERE publicat_en IS NULL",
		size: "SELECT pg_total_relation_size($1::text::regclass)",
	}
	if wal {
		q.wal = newWALQueries(n)
		q.table = q.wal.table
		q.lag = q.wal.lag
	}
	return q
}

// parkedAggregates are the aggregates with a parked row. In table mode
// every later row of one waits (the value is 0); in WAL mode the value is
// the position of its first parked or waiting message, and the messages
// from there on wait (walBlocked).
func (r *Relay) parkedAggregates(ctx context.Context, conn *pgx.Conn) (map[string]pglogrepl.LSN, error) {
	if r.cfg.WAL {
		return r.walBlocked(ctx, conn)
	}
	rows, err := conn.Query(ctx, r.q.parked)
	if err != nil {
		return nil, fmt.Errorf("cdc: read parked rows: %w", err)
	}
	aggs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("cdc: read parked rows: %w", err)
	}
	out := make(map[string]pglogrepl.LSN, len(aggs))
	for _, a := range aggs {
		out[a] = 0
	}
	return out, nil
}

// pipeline publishes rows in the order it is given them, one batch after the
// other, and hands each confirmed batch to the marker.
type pipeline struct {
	r       *Relay
	blocked map[string]pglogrepl.LSN // aggregates with a parked row: their rows (from that position) stay pending
	// skips are the catch-ups whose rows the stream may deliver again.
	skips    []skip
	marker   *marker
	inflight *flight // the batch at the broker, if any
}

// skip is what a catch-up that did not read the slot's own snapshot
// published: the pending rows, of aggs (nil: of every aggregate), of the
// transactions its snapshot shows committed. The stream skips their rows,
// whether the catch-up published them or found them published already, and
// delivers those of every other transaction. Every transaction the snapshot
// shows committed ends at or before bound.
type skip struct {
	snap  snapshot
	aggs  map[string]bool
	bound pglogrepl.LSN
}

func newPipeline(r *Relay, blocked map[string]pglogrepl.LSN, m *marker) *pipeline {
	return &pipeline{r: r, blocked: blocked, marker: m}
}

// skipped reports whether a catch-up holds the row of aggregate agg that
// transaction xid inserted.
func (p *pipeline) skipped(xid uint32, agg string) bool {
	for _, s := range p.skips {
		if (s.aggs == nil || s.aggs[agg]) && s.snap.committed(xid) {
			return true
		}
	}
	return false
}

// catchUp publishes the pending rows that the stream will not deliver, in
// creat_en order (commit order per aggregate): all of them, or those of
// aggs. tx, if not nil, is a transaction holding the new slot's snapshot
// (exact: the stream holds exactly the rows committed after it). Otherwise
// the rows it reads may come again in the stream: the stream skips the
// rows of the transactions its snapshot shows committed (a skip), and the
// relay keeps no id of them, however many there are.
func (p *pipeline) catchUp(ctx context.Context, conn *pgx.Conn, tx pgx.Tx, exact bool, aggs []string) error {
	var err error
	if tx == nil {
		if tx, err = conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}); err != nil {
			return fmt.Errorf("cdc: catch-up: %w", err)
		}
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // read only
	var hasHdr bool
	if err := tx.QueryRow(ctx, p.r.q.hasHdr, p.r.q.table).Scan(&hasHdr); err != nil {
		return fmt.Errorf("cdc: catch-up: %w", err)
	}
	var snap snapshot
	if !exact {
		// The transaction's snapshot (REPEATABLE READ: taken by the
		// statement above), the one the rows below are read in.
		var text string
		if err := tx.QueryRow(ctx, "SELECT pg_current_snapshot()::text").Scan(&text); err != nil {
			return fmt.Errorf("cdc: catch-up: %w", err)
		}
		if snap, err = parseSnapshot(text); err != nil {
			return fmt.Errorf("cdc: catch-up: %w", err)
		}
	}
	sql, args := p.r.q.pending, []any(nil)
	if aggs != nil {
		sql, args = p.r.q.pendOf, []any{aggs}
	}
	if hasHdr {
		sql = strings.Replace(sql, "NULL::jsonb", "o."+colHeaders, 1)
	}
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return fmt.Errorf("cdc: catch-up: %w", err)
	}
	batch := make([]outbox.Row, 0, 256)
	tids := make([]pgtype.TID, 0, 256)
	total := 0
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		total += len(batch)
		err := p.publish(ctx, batch, tids, nil, 0, time.Time{})
		batch, tids = make([]outbox.Row, 0, len(batch)), make([]pgtype.TID, 0, len(tids)) // the batch may still be in flight
		return err
	}
	for rows.Next() {
		var row outbox.Row
		var id pgtype.UUID
		var hdr []byte
		var tid pgtype.TID
		if err := rows.Scan(&id, &row.Aggregate, &row.AggregateID, &row.Type, &row.Version, &row.Payload, &row.CreatedAt, &hdr, &tid); err != nil {
			rows.Close()
			return fmt.Errorf("cdc: catch-up: %w", err)
		}
		row.ID = id.Bytes
		if hdr != nil {
			setHeaders(p.r.cfg.Logger, &row, hdr)
		}
		batch = append(batch, row)
		tids = append(tids, tid)
		if len(batch) == p.r.cfg.BatchSize {
			if err := flush(); err != nil {
				rows.Close()
				return err
			}
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("cdc: catch-up: %w", err)
	}
	if err := flush(); err != nil {
		return err
	}
	if err := p.flush(ctx); err != nil {
		return err
	}
	if !exact {
		// Every transaction the snapshot shows committed wrote its commit
		// record before this position; later transactions of the stream
		// are none of them.
		var bound pglogrepl.LSN
		if err := tx.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()").Scan(&bound); err != nil {
			return fmt.Errorf("cdc: catch-up: %w", err)
		}
		sk := skip{snap: snap, bound: bound}
		if aggs != nil {
			sk.aggs = make(map[string]bool, len(aggs))
			for _, a := range aggs {
				sk.aggs[a] = true
			}
		}
		p.skips = append(p.skips, sk)
	}
	if total > 0 {
		p.r.cfg.Logger.Info("cdc: caught up with pending rows", "relay", p.r.q.payload, "rows", total, "aggregates", len(aggs))
	}
	return tx.Commit(ctx)
}

// stream publishes what the reader delivers, batch after batch, until a
// failure or ctx's end. Between batches it looks for released aggregates.
func (p *pipeline) stream(ctx context.Context, in <-chan item, readerExit <-chan struct{}, readerErr func() error, lock *pgx.Conn) error {
	tick := time.NewTicker(p.r.cfg.ReleaseCheck)
	defer tick.Stop()
	var items []item
	for {
		var confirmedCh <-chan error
		if p.inflight != nil {
			confirmedCh = p.inflight.done
		}
		select {
		case err := <-confirmedCh: // marked at once, not when the next batch comes
			f := p.inflight
			p.inflight = nil
			if err := p.confirmed(ctx, f, err); err != nil {
				return err
			}
			continue
		case <-ctx.Done():
			return ctx.Err()
		case <-readerExit:
			return readerErr()
		case <-p.marker.dead:
			return p.marker.err
		case <-tick.C:
			if len(p.blocked) > 0 {
				if err := p.releases(ctx, lock); err != nil {
					return err
				}
			}
			continue
		case it := <-in:
			items = append(items[:0], it)
		}
		n := len(items[0].rows)
	more:
		for n < p.r.cfg.BatchSize {
			select {
			case it := <-in:
				items = append(items, it)
				n += len(it.rows)
			default:
				break more
			}
		}
		if err := p.streamed(ctx, items, n); err != nil {
			return err
		}
	}
}

// streamed publishes the rows of items, skipping those the catch-up
// published, and confirms up to the end of the last whole transaction.
func (p *pipeline) streamed(ctx context.Context, items []item, n int) error {
	rows := make([]outbox.Row, 0, n)
	var lsns []pglogrepl.LSN // WAL mode: each row's message position
	var end pglogrepl.LSN
	var commit time.Time
	for _, it := range items {
		if it.end != 0 && len(p.skips) > 0 {
			// This transaction and every later one committed after the
			// snapshots of the skips it passed.
			p.skips = slices.DeleteFunc(p.skips, func(s skip) bool { return it.end > s.bound })
		}
		for i, row := range it.rows {
			if len(p.skips) > 0 && p.skipped(it.xid, row.AggregateID) {
				continue
			}
			rows = append(rows, row)
			if it.lsns != nil {
				lsns = append(lsns, it.lsns[i])
			}
		}
		if it.end != 0 {
			end, commit = it.end, it.commit
			p.r.lag.received(end, commit)
		}
	}
	p.r.cfg.Logger.Debug("cdc: batch", "items", len(items), "rows", len(rows), "end", end.String())
	return p.publish(ctx, rows, nil, lsns, end, commit)
}

// releases finds the aggregates an operator released (no parked row any
// more) and publishes their pending rows, in order, before the stream goes
// on.
func (p *pipeline) releases(ctx context.Context, lock *pgx.Conn) error {
	if err := p.flush(ctx); err != nil {
		return err
	}
	if err := p.marker.wait(ctx); err != nil { // parkings of earlier batches committed
		return err
	}
	if p.r.cfg.WAL {
		return p.walReleases(ctx, lock)
	}
	parked, err := p.r.parkedAggregates(ctx, lock)
	if err != nil {
		return err
	}
	var released []string
	for a := range p.blocked {
		if _, still := parked[a]; !still {
			released = append(released, a)
			delete(p.blocked, a)
		}
	}
	if len(released) == 0 {
		return nil
	}
	return p.catchUp(ctx, lock, nil, false, released)
}

// Row states within one batch.
const (
	held   uint8 = iota // behind its aggregate's parked row: stays pending
	sent                // its records were handed to the broker
	parked              // refused for good: parked
)

// flight is a batch handed to the broker whose confirmation the pipeline
// has not processed yet.
type flight struct {
	rows  []outbox.Row
	lsns  []pglogrepl.LSN // WAL mode: each row's message position, or nil
	state []uint8
	owner []int // owner[i] is the row of record i
	msgs  []*transport.Message
	aggs  map[string]struct{} // aggregates with a record in msgs
	j     job
	tids  []pgtype.TID
	done  chan error // Publish's result
}

// publish hands rows to the broker in one Publish (all their records), and
// queues the marks and parkings, with end, the position to confirm once
// they are committed (0: none), once the broker confirmed every record. A
// row the relay or the broker refuses for good is parked, and the later
// rows of its aggregate stay pending behind it; a later row of its
// aggregate already in the same Publish was confirmed by the broker and is
// marked (as in the polling relay: MaxRecordBytes and the publisher's
// transport.Checker refuse before sending whatever they can foresee).
//
// Two batches may be at the broker at once, only when no aggregate has
// records in both: a batch that shares an aggregate with the one in flight
// waits for its confirmation first, so each aggregate's batches are
// published one after the other, in stream order. publish returns with at
// most this batch in flight; flush waits for it.
//
// tids, when not nil, are the rows' ctids as the catch-up read them: the
// marker marks by ctid (and id), a quarter of the cost of marking by id.
//
// lsns, when not nil (WAL mode), are the rows' message positions: a row
// that waits behind a parked one is stored with it (the slot moves past
// it), and only rows from the parked one's position on wait.
func (p *pipeline) publish(ctx context.Context, rows []outbox.Row, tids []pgtype.TID, lsns []pglogrepl.LSN, end pglogrepl.LSN, commit time.Time) error {
	f := &flight{rows: rows, lsns: lsns, state: make([]uint8, len(rows)), j: job{end: end, commit: commit}, tids: tids,
		aggs: make(map[string]struct{}, len(rows))}
	for i := range rows {
		row := &rows[i]
		if p.held(row.AggregateID, f.lsn(i)) {
			if p.r.cfg.WAL {
				f.j.store(row, f.lsn(i), nil)
			}
			continue
		}
		recs, reason := p.r.enc.Records(row)
		if reason != "" {
			f.state[i] = parked
			p.park(&f.j, row, f.lsn(i), reason)
			continue
		}
		f.state[i] = sent
		f.aggs[row.AggregateID] = struct{}{}
		for _, m := range recs {
			f.msgs = append(f.msgs, m)
			f.owner = append(f.owner, i)
		}
	}
	prev := p.inflight
	if prev != nil && overlap(prev.aggs, f.aggs) {
		if err := p.flush(ctx); err != nil {
			return err
		}
		prev = nil
	}
	f.done = make(chan error, 1)
	if len(f.msgs) == 0 {
		f.done <- nil
	} else {
		go func() {
			pctx, cancel := context.WithTimeout(ctx, p.r.cfg.PublishTimeout)
			defer cancel()
			f.done <- p.r.cfg.Publisher.Publish(pctx, f.msgs)
		}()
	}
	p.inflight = f
	if prev != nil {
		return p.finish(ctx, prev)
	}
	return nil
}

// flush waits for the batch in flight, if any, and queues its marks.
func (p *pipeline) flush(ctx context.Context) error {
	f := p.inflight
	if f == nil {
		return nil
	}
	p.inflight = nil
	return p.finish(ctx, f)
}

// finish waits for f's confirmation, parks what the broker refused and
// queues the marks.
func (p *pipeline) finish(ctx context.Context, f *flight) error {
	select {
	case err := <-f.done:
		return p.confirmed(ctx, f, err)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// confirmed processes Publish's result err for f.
func (p *pipeline) confirmed(ctx context.Context, f *flight, err error) error {
	var rej *transport.RejectedError
	switch {
	case err == nil:
	case errors.As(err, &rej):
		for k, idx := range rej.Index {
			if idx < 0 || idx >= len(f.owner) || f.state[f.owner[idx]] == parked {
				continue
			}
			reason := "unknown"
			if k < len(rej.Errs) && rej.Errs[k] != nil {
				reason = rej.Errs[k].Error()
			}
			f.state[f.owner[idx]] = parked
			p.park(&f.j, &f.rows[f.owner[idx]], f.lsn(f.owner[idx]), relaycore.Clip("broker: "+reason))
		}
	default:
		return fmt.Errorf("cdc: publish %d records: %w", len(f.msgs), err)
	}
	for i := range f.rows {
		if f.state[i] == sent {
			f.j.ids = append(f.j.ids, pgtype.UUID{Bytes: f.rows[i].ID, Valid: true})
			if f.j.fromParked {
				f.j.walDone = append(f.j.walDone, f.rows[i].ID)
			}
			if f.tids != nil {
				f.j.tids = append(f.j.tids, f.tids[i])
			}
		}
	}
	if h := p.r.faults.AfterPublish; h != nil {
		if err := h(len(f.j.ids)); err != nil {
			return &crashError{err}
		}
	}
	return p.marker.add(ctx, f.j)
}

func overlap(a, b map[string]struct{}) bool {
	if len(b) < len(a) {
		a, b = b, a
	}
	for k := range a {
		if _, ok := b[k]; ok {
			return true
		}
	}
	return false
}

// held reports whether the row of aggregate agg at lsn (0 in table mode)
// waits behind a parked row.
func (p *pipeline) held(agg string, lsn pglogrepl.LSN) bool {
	at, ok := p.blocked[agg]
	return ok && lsn >= at
}

// lsn is row i's message position, 0 in table mode.
func (f *flight) lsn(i int) pglogrepl.LSN {
	if f.lsns == nil {
		return 0
	}
	return f.lsns[i]
}

func (p *pipeline) park(j *job, row *outbox.Row, lsn pglogrepl.LSN, reason string) {
	if at, ok := p.blocked[row.AggregateID]; !ok || lsn < at {
		p.blocked[row.AggregateID] = lsn
	}
	if p.r.cfg.WAL {
		j.store(row, lsn, &reason)
	} else {
		j.parkIDs = append(j.parkIDs, row.ID)
		j.parkAggs = append(j.parkAggs, row.AggregateID)
		j.parkWhy = append(j.parkWhy, reason)
	}
	p.r.cfg.Logger.Error("cdc: row parked: its aggregate waits until it is released",
		"relay", p.r.q.payload, "id", row.ID, "agregat_id", row.AggregateID, "tipus", row.Type, "motiu", reason)
}
