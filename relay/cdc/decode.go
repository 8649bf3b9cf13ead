package cdc

import (
	"encoding/json"
	"fmt"
	"strconv"

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
}

func newDecoder(names migrate.Names) *decoder {
	return &decoder{names: names.WithDefaults(), rels: map[uint32]*relation{}, types: pgtype.NewMap()}
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

// insert decodes an Insert message. ok is false for a table other than the
// outbox and for a row inserted already published (publicat_en set): there
// is nothing to relay.
func (d *decoder) insert(m *pglogrepl.InsertMessage) (row outbox.Row, ok bool, err error) {
	rel := d.rels[m.RelationID]
	if rel == nil {
		return row, false, fmt.Errorf("cdc: insert into relation %d before its Relation message", m.RelationID)
	}
	if !rel.outbox {
		return row, false, nil
	}
	cols := m.Tuple.Columns
	val := func(i int) ([]byte, bool) {
		if i == noColumn || i >= len(cols) || cols[i].DataType != pglogrepl.TupleDataTypeText {
			return nil, false
		}
		return cols[i].Data, true
	}
	if _, set := val(rel.published); set {
		return row, false, nil
	}
	text := func(i int, name string) (string, error) {
		b, set := val(i)
		if !set {
			return "", fmt.Errorf("cdc: outbox row without %s", name)
		}
		return string(b), nil
	}
	b, set := val(rel.id)
	if !set {
		return row, false, fmt.Errorf("cdc: outbox row without %s", colID)
	}
	if row.ID, err = uuid.ParseBytes(b); err != nil {
		return row, false, fmt.Errorf("cdc: outbox %s %q: %w", colID, b, err)
	}
	if row.Aggregate, err = text(rel.aggregate, colAggregate); err != nil {
		return row, false, err
	}
	if row.AggregateID, err = text(rel.aggID, colAggID); err != nil {
		return row, false, err
	}
	if row.Type, err = text(rel.typ, colType); err != nil {
		return row, false, err
	}
	v, err := text(rel.version, colVersion)
	if err != nil {
		return row, false, err
	}
	if row.Version, err = strconv.Atoi(v); err != nil {
		return row, false, fmt.Errorf("cdc: outbox %s %q: %w", colVersion, v, err)
	}
	if row.Payload, set = val(rel.payload); !set {
		return row, false, fmt.Errorf("cdc: outbox row without %s", colPayload)
	}
	if b, set = val(rel.createdAt); !set {
		return row, false, fmt.Errorf("cdc: outbox row without %s", colCreatedAt)
	}
	if err := d.types.Scan(pgtype.TimestamptzOID, pgtype.TextFormatCode, b, &row.CreatedAt); err != nil {
		return row, false, fmt.Errorf("cdc: outbox %s %q: %w", colCreatedAt, b, err)
	}
	if b, set = val(rel.headers); set {
		row.Headers = headers(b)
	}
	return row, true, nil
}

// headers decodes capcaleres: a flat JSON object whose string values are
// headers. Other values, and a value that is not an object, are ignored.
func headers(b []byte) map[string]string {
	var raw map[string]any
	if json.Unmarshal(b, &raw) != nil || len(raw) == 0 {
		return nil
	}
	out := make(map[string]string, len(raw))
	for k, v := range raw {
		if s, ok := v.(string); ok {
			out[k] = s
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}
