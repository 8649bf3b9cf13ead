package cdc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
)

// walQueries are the statements of a WAL-mode outbox's parking table
// (migrate.WALParkedSuffix): the only table the WAL mode writes, and only
// for an event the broker refused for good and the events of its aggregate
// behind it.
type walQueries struct {
	table   string // quoted, schema-qualified
	store   string // $1..$10 arrays: keep messages (ON CONFLICT: keep the row, set a new motiu)
	done    string // $1 ids uuid[]: published, delete
	blocked string // aggregate -> position of its first kept message
	parked  string // aggregates with a refused message (motiu set)
	pending string // $1 agregat_ids text[]: their kept messages, in WAL order
	lag     string
}

func newWALQueries(n migrate.Names) walQueries {
	t := pgx.Identifier{n.Schema, n.Outbox + migrate.WALParkedSuffix}.Sanitize()
	return walQueries{
		table: t,
		store: "INSERT INTO " + t + " AS t (id, lsn, agregat, agregat_id, tipus, versio, carrega, creat_en, capcaleres, motiu)" +
			" SELECT * FROM unnest($1::uuid[], $2::pg_lsn[], $3::text[], $4::text[], $5::text[], $6::int[], $7::jsonb[]," +
			" $8::timestamptz[], $9::jsonb[], $10::text[])" +
			" ON CONFLICT (id) DO UPDATE SET motiu = coalesce(EXCLUDED.motiu, t.motiu)",
		done:    "DELETE FROM " + t + " WHERE id = ANY($1::uuid[])",
		blocked: "SELECT agregat_id, min(lsn)::text FROM " + t + " GROUP BY agregat_id",
		parked:  "SELECT DISTINCT agregat_id FROM " + t + " WHERE motiu IS NOT NULL",
		pending: "SELECT id, lsn::text, agregat, agregat_id, tipus, versio, carrega, creat_en, capcaleres FROM " + t +
			" WHERE agregat_id = ANY($1::text[]) ORDER BY lsn",
		lag: "SELECT count(*), coalesce(extract(epoch FROM now() - min(creat_en)), 0)::float8 FROM " + t,
	}
}

// walRows are messages to keep in the parking table, column by column.
type walRows struct {
	ids                 []uuid.UUID
	lsns                []string
	aggs, aggIDs, types []string
	versions            []int32
	payloads            []string
	created             []time.Time
	headers             []*string
	why                 []*string // motiu: set for a refused message, nil for one waiting
}

// store keeps row (at lsn) in the parking table when the job commits, as
// refused for why, or waiting behind its aggregate's refused one (why nil).
func (j *job) store(row *outbox.Row, lsn pglogrepl.LSN, why *string) {
	w := &j.wal
	var hdr *string
	if len(row.Headers) > 0 {
		if b, err := json.Marshal(row.Headers); err == nil {
			h := string(b)
			hdr = &h
		}
	}
	w.ids = append(w.ids, row.ID)
	w.lsns = append(w.lsns, lsn.String())
	w.aggs, w.aggIDs, w.types = append(w.aggs, row.Aggregate), append(w.aggIDs, row.AggregateID), append(w.types, row.Type)
	w.versions = append(w.versions, int32(row.Version))
	w.payloads = append(w.payloads, string(row.Payload))
	w.created = append(w.created, row.CreatedAt)
	w.headers = append(w.headers, hdr)
	w.why = append(w.why, why)
}

func (w *walRows) append(o *walRows) {
	w.ids, w.lsns = append(w.ids, o.ids...), append(w.lsns, o.lsns...)
	w.aggs, w.aggIDs, w.types = append(w.aggs, o.aggs...), append(w.aggIDs, o.aggIDs...), append(w.types, o.types...)
	w.versions, w.payloads = append(w.versions, o.versions...), append(w.payloads, o.payloads...)
	w.created, w.headers, w.why = append(w.created, o.created...), append(w.headers, o.headers...), append(w.why, o.why...)
}

func (w *walRows) queue(b *pgx.Batch, sql string) {
	b.Queue(sql, w.ids, w.lsns, w.aggs, w.aggIDs, w.types, w.versions, w.payloads, w.created, w.headers, w.why)
}

func (w *walRows) parkedCount() int {
	n := 0
	for _, y := range w.why {
		if y != nil {
			n++
		}
	}
	return n
}

// walBlocked reads, for every aggregate with kept messages, the position of
// the first: the stream's messages of that aggregate from there on wait (a
// message before it was published before the refused one).
func (r *Relay) walBlocked(ctx context.Context, conn *pgx.Conn) (map[string]pglogrepl.LSN, error) {
	rows, err := conn.Query(ctx, r.q.wal.blocked)
	if err != nil {
		return nil, fmt.Errorf("cdc: read parked messages: %w", err)
	}
	out := map[string]pglogrepl.LSN{}
	var agg, text string
	_, err = pgx.ForEachRow(rows, []any{&agg, &text}, func() error {
		lsn, err := pglogrepl.ParseLSN(text)
		out[agg] = lsn
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("cdc: read parked messages: %w", err)
	}
	return out, nil
}

// walReleases publishes, in WAL order, the kept messages of the aggregates
// none of whose messages is refused any more (an operator released it:
// ReleaseWAL), and deletes each one the broker confirms. A message refused
// again is parked again and the rest keep waiting.
func (p *pipeline) walReleases(ctx context.Context, conn *pgx.Conn) error {
	rows, err := conn.Query(ctx, p.r.q.wal.parked)
	if err != nil {
		return fmt.Errorf("cdc: read parked messages: %w", err)
	}
	stillParked, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("cdc: read parked messages: %w", err)
	}
	parked := make(map[string]bool, len(stillParked))
	for _, a := range stillParked {
		parked[a] = true
	}
	var released []string
	for a := range p.blocked {
		if !parked[a] {
			released = append(released, a)
			delete(p.blocked, a)
		}
	}
	if len(released) == 0 {
		return nil
	}
	rows, err = conn.Query(ctx, p.r.q.wal.pending, released)
	if err != nil {
		return fmt.Errorf("cdc: read released messages: %w", err)
	}
	var batch []outbox.Row
	var lsns []pglogrepl.LSN
	for rows.Next() {
		var row outbox.Row
		var id pgtype.UUID
		var lsn string
		var hdr []byte
		if err := rows.Scan(&id, &lsn, &row.Aggregate, &row.AggregateID, &row.Type, &row.Version, &row.Payload, &row.CreatedAt, &hdr); err != nil {
			rows.Close()
			return fmt.Errorf("cdc: read released messages: %w", err)
		}
		row.ID = id.Bytes
		if hdr != nil {
			setHeaders(p.r.cfg.Logger, &row, hdr)
		}
		at, err := pglogrepl.ParseLSN(lsn)
		if err != nil {
			rows.Close()
			return fmt.Errorf("cdc: read released messages: %w", err)
		}
		batch, lsns = append(batch, row), append(lsns, at)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("cdc: read released messages: %w", err)
	}
	for i := 0; i < len(batch); i += p.r.cfg.BatchSize {
		k := min(i+p.r.cfg.BatchSize, len(batch))
		if err := p.publishKept(ctx, batch[i:k], lsns[i:k]); err != nil {
			return err
		}
	}
	if err := p.flush(ctx); err != nil {
		return err
	}
	p.r.cfg.Logger.Info("cdc: released parked messages", "relay", p.r.q.payload, "messages", len(batch), "aggregates", len(released))
	return p.marker.wait(ctx)
}

// publishKept is publish for messages read back from the parking table:
// those the broker confirms are deleted from it.
func (p *pipeline) publishKept(ctx context.Context, rows []outbox.Row, lsns []pglogrepl.LSN) error {
	if err := p.publish(ctx, rows, nil, lsns, 0, time.Time{}); err != nil {
		return err
	}
	p.inflight.j.fromParked = true // before its confirmation is processed (flush, finish)
	return nil
}

// walMessage decodes a logical decoding message of the stream: one of the
// outbox's (transactional, with its prefix) becomes a row of the current
// transaction; any other is ignored. Content that is not EncodeWAL's is
// logged and skipped: it cannot be published (no id, no key).
func (rd *reader) walMessage(m *pglogrepl.LogicalDecodingMessage) (outbox.Row, bool) {
	if m.Prefix != rd.r.prefix {
		return outbox.Row{}, false
	}
	if !m.Transactional {
		rd.r.cfg.Logger.Error("cdc: non-transactional message with the outbox's prefix skipped: write events with Enqueue",
			"relay", rd.r.q.payload, "lsn", m.LSN.String())
		return outbox.Row{}, false
	}
	// m.Content points into the receive buffer; the row DecodeWAL returns
	// refers to none of it.
	row, hdrErr, err := outbox.DecodeWAL(m.Content)
	if err != nil {
		rd.r.cfg.Logger.Error("cdc: message with the outbox's prefix skipped: its content is not an event",
			"relay", rd.r.q.payload, "lsn", m.LSN.String(), "err", err)
		return outbox.Row{}, false
	}
	if hdrErr != nil {
		rd.r.cfg.Logger.Warn("cdc: capcaleres dropped in part", "id", row.ID, "tipus", row.Type, "error", hdrErr)
	}
	return row, true
}

// ensureWALPublication makes sure of the WAL mode's publication, which
// publishes no table: pgoutput needs one to start (the messages pass
// without one) and looks it up as of each change it decodes, so it must be
// older than the slot. It is created here only with the slot (slot false:
// the slot does not exist yet); a slot without it is an ErrSetup error.
func (r *Relay) ensureWALPublication(ctx context.Context, conn *pgx.Conn, slot bool) error {
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", r.cfg.Publication).Scan(&exists); err != nil {
		return fmt.Errorf("cdc: read publication: %w", err)
	}
	switch {
	case exists:
		return nil
	case slot:
		return fmt.Errorf("%w: slot %s exists but publication %s does not: PostgreSQL would fail on every change "+
			"written before a publication created now; create both with km0 migrate --outbox-mode wal (publication first)",
			ErrSetup, r.cfg.Slot, r.cfg.Publication)
	}
	err := migrate.EnsurePublication(ctx, conn, r.cfg.Publication)
	if err == nil {
		r.cfg.Logger.Info("cdc: publication created (no table: WAL mode)", "publication", r.cfg.Publication, "outbox", r.q.payload)
		return nil
	}
	if errors.Is(err, migrate.ErrSlot) {
		return fmt.Errorf("%w: %w", ErrSetup, err)
	}
	return fmt.Errorf("cdc: %w", err)
}

// ReleaseWAL releases the parked message id of the WAL-mode outbox names:
// the relay publishes it again, then the messages of its aggregate waiting
// behind it, in WAL order, within Config.ReleaseCheck. It returns
// relay.ErrNotParked (wrapped) if id is not a parked message.
func ReleaseWAL(ctx context.Context, db outbox.DBTX, names migrate.Names, id uuid.UUID) error {
	names = names.WithDefaults()
	t := pgx.Identifier{names.Schema, names.Outbox + migrate.WALParkedSuffix}.Sanitize()
	tag, err := db.Exec(ctx, "UPDATE "+t+" SET motiu = NULL WHERE id = $1 AND motiu IS NOT NULL", pgtype.UUID{Bytes: id, Valid: true})
	if err != nil {
		return fmt.Errorf("cdc: release: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %s", relay.ErrNotParked, id)
	}
	return nil
}
