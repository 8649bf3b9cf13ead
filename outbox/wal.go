package outbox

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/km0/km0/migrate"
)

// Mode is where an Outbox writes its events.
type Mode string

// Modes of Config.Mode.
const (
	// ModeTable writes each event as a row of the outbox table (CONTRACT.md),
	// published by the polling relay (package relay) or the CDC relay
	// (package relay/cdc). The default.
	ModeTable Mode = "table"
	// ModeWAL writes each event into the write-ahead log as a transactional
	// logical decoding message, pg_logical_emit_message(true, prefix,
	// content) (migrate.WALPrefix, EncodeWAL), on the caller's transaction:
	// decoded at commit, in commit order, or never on rollback. No row, no
	// index entry, nothing to mark or vacuum. Only the CDC relay in WAL mode
	// (cdc.Config.WAL) publishes them, and the outbox's replication slot is
	// the only durable store: Enqueue refuses to write while the slot is
	// missing or invalidated (ErrNoSlot). Needs wal_level = logical.
	ModeWAL Mode = "wal"
)

// SlotCheckIntervalDefault is how long a WAL-mode Outbox trusts its last
// look at its slot (Config.SlotCheckInterval).
const SlotCheckIntervalDefault = time.Second

// ErrNoSlot is wrapped by the error of a WAL-mode Enqueue while the outbox's
// replication slot does not exist (or is not a pgoutput slot of this
// database, or is still being created) or is invalidated (wal_status lost):
// a message written then would be lost. Nothing is written; create the slot
// with km0 migrate --outbox-mode wal (migrate.EnsureWALSlot) and retry.
var ErrNoSlot = errors.New("outbox: the WAL-mode outbox's replication slot is missing or invalidated")

// walContentVersion is the v member of EncodeWAL's content.
const walContentVersion = 1

// walContent is the content of a WAL-mode message (docs/contract.md).
type walContent struct {
	V         int             `json:"v"`
	ID        string          `json:"id"`
	Aggregate string          `json:"agregat"`
	AggID     string          `json:"agregat_id"`
	Type      string          `json:"tipus"`
	Version   int             `json:"versio"`
	CreatedAt string          `json:"creat_en"`
	Payload   json.RawMessage `json:"carrega"`
	Headers   json.RawMessage `json:"capcaleres,omitempty"`
}

// walTime is creat_en's format: RFC 3339 in UTC with microseconds, as
// PostgreSQL keeps a timestamptz.
const walTime = "2006-01-02T15:04:05.000000Z07:00"

// EncodeWAL is the content of the logical decoding message of r in WAL mode
// (docs/contract.md): a JSON object with v (1, the format's version), id,
// agregat, agregat_id, tipus, versio, creat_en (RFC 3339, UTC,
// microseconds), carrega (the dades object) and, when r has headers,
// capcaleres (a flat object of strings). It fails for a payload that is not
// valid JSON.
func EncodeWAL(r *Row) ([]byte, error) {
	if !json.Valid(r.Payload) {
		return nil, errors.New("outbox: encode WAL content: carrega is not valid JSON")
	}
	var hdr json.RawMessage
	if len(r.Headers) > 0 {
		b, err := json.Marshal(r.Headers)
		if err != nil {
			return nil, fmt.Errorf("outbox: encode capcaleres: %w", err)
		}
		hdr = b
	}
	return encodeWAL(r, hdr)
}

// encodeWAL writes the content by hand, in walContent's member order: a
// third of json.Marshal's cost, which also compacts (scans) the payload
// again. payload and hdr must be valid JSON (prepare and encodeHeaders made
// them; EncodeWAL checks a caller's).
func encodeWAL(r *Row, hdr json.RawMessage) ([]byte, error) {
	b := make([]byte, 0, 192+len(r.Aggregate)+len(r.AggregateID)+len(r.Type)+len(r.Payload)+len(hdr))
	b = append(b, `{"v":`...)
	b = strconv.AppendInt(b, walContentVersion, 10)
	b = append(b, `,"id":"`...)
	var id [36]byte
	hex.Encode(id[0:8], r.ID[0:4])
	hex.Encode(id[9:13], r.ID[4:6])
	hex.Encode(id[14:18], r.ID[6:8])
	hex.Encode(id[19:23], r.ID[8:10])
	hex.Encode(id[24:], r.ID[10:])
	id[8], id[13], id[18], id[23] = '-', '-', '-', '-'
	b = append(b, id[:]...)
	b = append(b, `","agregat":`...)
	b = appendJSONString(b, r.Aggregate)
	b = append(b, `,"agregat_id":`...)
	b = appendJSONString(b, r.AggregateID)
	b = append(b, `,"tipus":`...)
	b = appendJSONString(b, r.Type)
	b = append(b, `,"versio":`...)
	b = strconv.AppendInt(b, int64(r.Version), 10)
	b = append(b, `,"creat_en":"`...)
	b = r.CreatedAt.UTC().AppendFormat(b, walTime)
	b = append(b, `","carrega":`...)
	b = append(b, r.Payload...)
	if len(hdr) > 0 {
		b = append(b, `,"capcaleres":`...)
		b = append(b, hdr...)
	}
	return append(b, '}'), nil
}

// appendJSONString appends s as a JSON string: '"', '\\' and control
// characters escaped, invalid UTF-8 replaced by U+FFFD (as encoding/json
// does; it also escapes <, > and &, which JSON does not need).
func appendJSONString(b []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// DecodeWAL reads the content of a WAL-mode message back into a Row. It
// fails, saying which member, for content that is not EncodeWAL's: not a
// JSON object, a v it does not know, a missing or malformed id, agregat,
// agregat_id, tipus, versio, creat_en or carrega. Headers go through
// DecodeHeaders: bad entries are dropped and reported in hdrErr, never
// failing the event. The row refers to no byte of content, which the
// caller may reuse.
//
// Content laid out as EncodeWAL writes it is read without reflection
// (scanWAL); any other valid layout (members in another order, escapes,
// white space) is read by encoding/json, with the same result.
func DecodeWAL(content []byte) (row Row, hdrErr error, err error) { return decodeWAL(content, true) }

// decodeWAL is DecodeWAL, trying scanWAL first when fast is set (the tests
// compare both paths).
func decodeWAL(content []byte, fast bool) (row Row, hdrErr error, err error) {
	var c walContent
	ok := false
	if fast {
		c, ok = scanWAL(content)
	}
	if !ok {
		c = walContent{}
		if err := json.Unmarshal(content, &c); err != nil {
			return row, nil, fmt.Errorf("outbox: WAL message: not a JSON object: %w", err)
		}
	}
	switch {
	case c.V != walContentVersion:
		return row, nil, fmt.Errorf("outbox: WAL message: v %d, want %d", c.V, walContentVersion)
	case c.Aggregate == "" || c.AggID == "" || c.Type == "":
		return row, nil, errors.New("outbox: WAL message: agregat, agregat_id or tipus is empty")
	case c.Version < 1:
		return row, nil, fmt.Errorf("outbox: WAL message: versio %d is not positive", c.Version)
	case len(c.Payload) == 0 || c.Payload[0] != '{':
		return row, nil, errors.New("outbox: WAL message: carrega is not a JSON object")
	}
	if row.ID, err = uuid.Parse(c.ID); err != nil {
		return row, nil, fmt.Errorf("outbox: WAL message: id %q: %w", c.ID, err)
	}
	if row.CreatedAt, err = time.Parse(time.RFC3339Nano, c.CreatedAt); err != nil {
		return row, nil, fmt.Errorf("outbox: WAL message: creat_en %q: %w", c.CreatedAt, err)
	}
	row.Aggregate, row.AggregateID, row.Type, row.Version, row.Payload = c.Aggregate, c.AggID, c.Type, c.Version, c.Payload
	if len(c.Headers) > 0 {
		row.Headers, hdrErr = decodeHeaders(c.Headers, fast)
	}
	return row, hdrErr, nil
}

// walState is a WAL-mode Outbox's last look at its slot.
type walState struct {
	mu      sync.Mutex
	slot    string // Config.Slot, or the default once the database is known
	checked time.Time
	err     error // nil: the slot was there and valid
}

// slotQuery reads the slot: "" when it is missing, not a pgoutput slot of
// this database, or still being created (no confirmed_flush_lsn yet).
const slotQuery = `SELECT coalesce((SELECT coalesce(wal_status, 'reserved') FROM pg_replication_slots
	WHERE slot_name = $1 AND database = current_database() AND plugin = 'pgoutput' AND confirmed_flush_lsn IS NOT NULL), '')`

// checkSlot returns nil when the slot was valid at a look at most
// SlotCheckInterval old, looking again (one query on db) otherwise.
func (o *Outbox) checkSlot(ctx context.Context, db DBTX) error {
	s := &o.wal
	s.mu.Lock()
	slot, checked, last := s.slot, s.checked, s.err
	s.mu.Unlock()
	if !checked.IsZero() && time.Since(checked) < o.cfg.SlotCheckInterval {
		return last
	}
	if slot == "" {
		var database string
		if err := db.QueryRow(ctx, "SELECT current_database()").Scan(&database); err != nil {
			return fmt.Errorf("outbox: read the database name: %w", err)
		}
		slot = migrate.WALSlot(database, o.cfg.Names)
	}
	var status string
	if err := db.QueryRow(ctx, slotQuery, slot).Scan(&status); err != nil {
		return fmt.Errorf("outbox: check slot %s: %w", slot, err)
	}
	var err error
	switch status {
	case "":
		err = fmt.Errorf("%w: slot %s does not exist in this database (or is still being created); "+
			"nothing may be written before it exists: run km0 migrate --outbox-mode wal", ErrNoSlot, slot)
	case "lost":
		err = fmt.Errorf("%w: slot %s is invalidated (wal_status lost): events written now would be lost; "+
			"see docs/cdc.md (an invalidated slot)", ErrNoSlot, slot)
	}
	s.mu.Lock()
	s.slot, s.checked, s.err = slot, time.Now(), err
	s.mu.Unlock()
	return err
}

// emit writes the messages of events (prepared payloads, encoded headers)
// in one statement, in the caller's order.
func (o *Outbox) emit(ctx context.Context, tx DBTX, events []*Event, payloads [][]byte, headers []*string) error {
	if err := o.checkSlot(ctx, tx); err != nil {
		return err
	}
	now := time.Now()
	contents := make([]string, len(events))
	for i, e := range events {
		var hdr json.RawMessage
		if headers != nil && headers[i] != nil {
			hdr = json.RawMessage(*headers[i])
		}
		b, err := encodeWAL(&Row{ID: e.ID, Aggregate: e.Aggregate, AggregateID: e.AggregateID, Type: e.Type,
			Version: e.Version, Payload: payloads[i], CreatedAt: now}, hdr)
		if err != nil {
			return fmt.Errorf("%w: %s: %v", ErrInvalid, e.Type, err)
		}
		contents[i] = string(b)
	}
	var err error
	if len(contents) == 1 {
		_, err = tx.Exec(ctx, "SELECT pg_logical_emit_message(true, $1::text, $2::text)", o.prefix, contents[0])
	} else {
		// A function scan returns the array's elements in order, and each
		// message is written as its row is produced.
		_, err = tx.Exec(ctx, "SELECT pg_logical_emit_message(true, $1::text, c) FROM unnest($2::text[]) AS c", o.prefix, contents)
	}
	if err != nil {
		return fmt.Errorf("outbox: emit %d message(s): %w", len(contents), err)
	}
	return nil
}
