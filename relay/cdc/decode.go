package cdc

import (
	"encoding/binary"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
)

// Column names of the outbox (CONTRACT.md). capcaleres is optional.
const (
	colID        = "id"
	colAggregate = "agregat"
	colAggID     = "agregat_id"
	colType      = "tipus"
	colVersion   = "versio"
	colPayload   = "carrega"
	colCreatedAt = "creat_en"
	colPublished = "publicat_en"
	colHeaders   = "capcaleres"
	noColumn     = -1
)

// relation is what the decoder knows of one table of the stream: whether it
// is the outbox, and the position of each outbox column in its tuples, read
// by name from the Relation message (so added, dropped or reordered columns
// never shift a value into the wrong field).
type relation struct {
	outbox                                                                     bool
	id, aggregate, aggID, typ, version, payload, createdAt, published, headers int
}

// decoder turns pgoutput messages of the outbox into rows.
type decoder struct {
	names migrate.Names
	rels  map[uint32]*relation
	types *pgtype.Map
	log   *slog.Logger // capcaleres partly dropped
}

func newDecoder(names migrate.Names, log *slog.Logger) *decoder {
	return &decoder{names: names.WithDefaults(), rels: map[uint32]*relation{}, types: pgtype.NewMap(), log: log}
}

// relation records a Relation message. It fails when the outbox lacks one of
// the required columns.
func (d *decoder) relation(m *pglogrepl.RelationMessage) error {
	rel := &relation{outbox: m.Namespace == d.names.Schema && m.RelationName == d.names.Outbox}
	d.rels[m.RelationID] = rel
	if !rel.outbox {
		return nil
	}
	pos := map[string]int{}
	for i, c := range m.Columns {
		pos[c.Name] = i
	}
	at := func(name string) int {
		if i, ok := pos[name]; ok {
			return i
		}
		return noColumn
	}
	rel.id, rel.aggregate, rel.aggID, rel.typ = at(colID), at(colAggregate), at(colAggID), at(colType)
	rel.version, rel.payload, rel.createdAt = at(colVersion), at(colPayload), at(colCreatedAt)
	rel.published, rel.headers = at(colPublished), at(colHeaders)
	for name, i := range map[string]int{colID: rel.id, colAggregate: rel.aggregate, colAggID: rel.aggID, colType: rel.typ,
		colVersion: rel.version, colPayload: rel.payload, colCreatedAt: rel.createdAt} {
		if i == noColumn {
			return fmt.Errorf("%w: the stream's %s.%s has no column %s", ErrSetup, m.Namespace, m.RelationName, name)
		}
	}
	return nil
}

// column is one value of a tuple as the stream sends it: kind is
// pglogrepl.TupleDataTypeText, ...Binary, ...Null or ...Toast; data points
// into the receive buffer and is valid only until the next message.
type column struct {
	kind byte
	data []byte
}

// parseInsert reads an Insert message ('I', relation id, 'N', the new
// tuple) into cols (reused), without copying the values.
func parseInsert(msg []byte, cols []column) (uint32, []column, error) {
	if len(msg) < 8 || msg[0] != byte(pglogrepl.MessageTypeInsert) || msg[5] != 'N' {
		return 0, cols, fmt.Errorf("cdc: malformed insert message")
	}
	rel := binary.BigEndian.Uint32(msg[1:5])
	n := int(binary.BigEndian.Uint16(msg[6:8]))
	cols = cols[:0]
	off := 8
	for range n {
		if off >= len(msg) {
			return 0, cols, fmt.Errorf("cdc: truncated insert message")
		}
		c := column{kind: msg[off]}
		off++
		if c.kind == pglogrepl.TupleDataTypeText || c.kind == pglogrepl.TupleDataTypeBinary {
			if off+4 > len(msg) {
				return 0, cols, fmt.Errorf("cdc: truncated insert message")
			}
			l := int(binary.BigEndian.Uint32(msg[off:]))
			off += 4
			if l < 0 || off+l > len(msg) {
				return 0, cols, fmt.Errorf("cdc: truncated insert message")
			}
			c.data = msg[off : off+l]
			off += l
		}
		cols = append(cols, c)
	}
	return rel, cols, nil
}

// insert decodes the new tuple of an Insert into relation rel. ok is false
// for a table other than the outbox and for a row inserted already
// published (publicat_en set): there is nothing to relay. The row owns its
// values (they are copied out of cols).
func (d *decoder) insert(rel uint32, cols []column) (row outbox.Row, ok bool, err error) {
	r := d.rels[rel]
	if r == nil {
		return row, false, fmt.Errorf("cdc: insert into relation %d before its Relation message", rel)
	}
	if !r.outbox {
		return row, false, nil
	}
	val := func(i int) ([]byte, bool) {
		if i == noColumn || i >= len(cols) || cols[i].kind != pglogrepl.TupleDataTypeText {
			return nil, false
		}
		return cols[i].data, true
	}
	if _, set := val(r.published); set {
		return row, false, nil
	}
	text := func(i int, name string) (string, error) {
		b, set := val(i)
		if !set {
			return "", fmt.Errorf("cdc: outbox row without %s", name)
		}
		return string(b), nil
	}
	b, set := val(r.id)
	if !set {
		return row, false, fmt.Errorf("cdc: outbox row without %s", colID)
	}
	if row.ID, err = uuid.ParseBytes(b); err != nil {
		return row, false, fmt.Errorf("cdc: outbox %s %q: %w", colID, b, err)
	}
	if row.Aggregate, err = text(r.aggregate, colAggregate); err != nil {
		return row, false, err
	}
	if row.AggregateID, err = text(r.aggID, colAggID); err != nil {
		return row, false, err
	}
	if row.Type, err = text(r.typ, colType); err != nil {
		return row, false, err
	}
	v, set := val(r.version)
	if !set {
		return row, false, fmt.Errorf("cdc: outbox row without %s", colVersion)
	}
	if row.Version, err = strconv.Atoi(string(v)); err != nil {
		return row, false, fmt.Errorf("cdc: outbox %s %q: %w", colVersion, v, err)
	}
	if b, set = val(r.payload); !set {
		return row, false, fmt.Errorf("cdc: outbox row without %s", colPayload)
	}
	row.Payload = append([]byte(nil), b...)
	if b, set = val(r.createdAt); !set {
		return row, false, fmt.Errorf("cdc: outbox row without %s", colCreatedAt)
	}
	if row.CreatedAt, err = d.timestamptz(b); err != nil {
		return row, false, fmt.Errorf("cdc: outbox %s %q: %w", colCreatedAt, b, err)
	}
	if b, set = val(r.headers); set {
		setHeaders(d.log, &row, b)
	}
	return row, true, nil
}

// isoTimestamptz is timestamptz_out's format under DateStyle ISO and
// TimeZone UTC, the replication session's settings.
const isoTimestamptz = "2006-01-02 15:04:05.999999999-07"

// timestamptz parses a timestamptz in text form: the common format
// directly, anything else (infinity, years past 9999) through pgtype.
func (d *decoder) timestamptz(b []byte) (time.Time, error) {
	if t, err := time.Parse(isoTimestamptz, string(b)); err == nil {
		return t, nil
	}
	var t time.Time
	err := d.types.Scan(pgtype.TimestamptzOID, pgtype.TextFormatCode, b, &t)
	return t, err
}

// setHeaders decodes capcaleres into row.Headers (outbox.DecodeHeaders,
// as the polling relay does). Bad metadata never holds back its event: it
// goes out with the entries that passed, and the rest is logged.
func setHeaders(log *slog.Logger, row *outbox.Row, b []byte) {
	var err error
	if row.Headers, err = outbox.DecodeHeaders(b); err != nil {
		log.Warn("cdc: capcaleres dropped in part", "id", row.ID, "tipus", row.Type, "error", err)
	}
}
