// Package outbox writes events into the transactional outbox of CONTRACT.md,
// inside the caller's own database transaction. Nothing here talks to a broker:
// the relay (package relay) publishes committed rows later. In WAL mode
// (Config.Mode = ModeWAL) the events are logical decoding messages of the
// same transaction instead of rows, published by the CDC relay in WAL mode
// (package relay/cdc); see ModeWAL.
//
// The event id is generated once, here, when the row is written (a UUIDv7, so
// ids of one process sort in write order). It becomes the id_esdeveniment and is
// never regenerated: every republication of the row carries the same id, which
// is what lets idempotent consumers absorb duplicates.
package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/tracing"
)

// Event is one event to enqueue.
type Event struct {
	// ID is the id_esdeveniment. Leave it zero: Enqueue sets a new UUIDv7.
	// Set it only to re-enqueue an event that already has an id.
	ID          uuid.UUID
	Aggregate   string // agregat, e.g. "comanda"; required
	AggregateID string // agregat_id, the partition key; required
	Type        string // tipus, e.g. "comanda.creada"; required
	Version     int    // versio; 0 means 1
	// Payload is the dades object: a json.RawMessage / []byte holding a JSON
	// object, or any value json.Marshal turns into one.
	Payload any
	// Headers are extra headers to publish with the event, stored in the
	// row's capcaleres and copied by the relay onto every record. Names may
	// not be km0's own (docs/tracing.md lists every rule). They
	// are merged with the trace context of Enqueue's ctx; a name set here
	// wins, so a batch handler can give each event the traceparent of the
	// message that caused it. Default nil.
	Headers map[string]string
}

// DBTX is what Enqueue needs (contract.DBTX): a pgx.Tx, a pool or a
// connection. Pass the transaction of the business write so that state and
// event commit together.
type DBTX = contract.DBTX

// ErrInvalid is wrapped by every error about an event that cannot be written.
var ErrInvalid = errors.New("outbox: invalid event")

// Validator checks an event's payload before it is written; see package schema.
// A non-nil error refuses the write.
type Validator func(tipus string, versio int, carrega []byte) error

// Config configures an Outbox. The zero value is usable.
type Config struct {
	// Names are the schema and table names; defaults are CONTRACT.md's
	// (public.outbox).
	Names migrate.Names
	// Validate, if set, is run on every event before it is written.
	Validate Validator
	// MaxPayloadBytes refuses payloads larger than this. Default
	// envelope.DefaultMaxBytes minus room for the envelope members.
	MaxPayloadBytes int
	// Mode is where events are written: ModeTable (the default, "") or
	// ModeWAL. Any other value makes every Enqueue fail with ErrInvalid.
	Mode Mode
	// Slot is, in WAL mode, the replication slot that must exist before
	// anything is written. Default migrate.WALSlot(<the database>, Names),
	// the relay's and km0 migrate's default.
	Slot string
	// SlotCheckInterval is, in WAL mode, how long one look at the slot is
	// trusted: Enqueue runs one query on the caller's transaction at most
	// this often, so a slot dropped meanwhile may go unnoticed for this long.
	// Default SlotCheckIntervalDefault.
	SlotCheckInterval time.Duration
}

// MaxPayloadBytesDefault leaves 4 KiB of the 1 MiB envelope limit for the
// envelope's own members.
const MaxPayloadBytesDefault = envelope.DefaultMaxBytes - 4096

// Outbox writes events. It is safe for concurrent use.
type Outbox struct {
	cfg          Config
	insertOne    string
	insertBatch  string
	insertOneH   string // with capcaleres
	insertBatchH string // with capcaleres
	prefix       string // ModeWAL: migrate.WALPrefix
	wal          walState
}

// New returns an Outbox for cfg.
func New(cfg Config) *Outbox {
	cfg.Names = cfg.Names.WithDefaults()
	if cfg.MaxPayloadBytes <= 0 {
		cfg.MaxPayloadBytes = MaxPayloadBytesDefault
	}
	if cfg.SlotCheckInterval <= 0 {
		cfg.SlotCheckInterval = SlotCheckIntervalDefault
	}
	if cfg.Mode == "" {
		cfg.Mode = ModeTable
	}
	table := pgx.Identifier{cfg.Names.Schema, cfg.Names.Outbox}.Sanitize()
	// Events without headers (the usual case) use the statements without
	// capcaleres: the column stays NULL at no cost.
	return &Outbox{
		cfg: cfg, prefix: migrate.WALPrefix(cfg.Names), wal: walState{slot: cfg.Slot},
		insertOne: "INSERT INTO " + table + " (id, agregat, agregat_id, tipus, versio, carrega) " +
			"VALUES ($1, $2, $3, $4, $5, $6)",
		insertBatch: "INSERT INTO " + table + " (id, agregat, agregat_id, tipus, versio, carrega) " +
			"SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::jsonb[])",
		insertOneH: "INSERT INTO " + table + " (id, agregat, agregat_id, tipus, versio, carrega, capcaleres) " +
			"VALUES ($1, $2, $3, $4, $5, $6, $7)",
		insertBatchH: "INSERT INTO " + table + " (id, agregat, agregat_id, tipus, versio, carrega, capcaleres) " +
			"SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::jsonb[], $7::jsonb[])",
	}
}

// Enqueue writes e inside tx and sets e.ID. It stores in the row's
// capcaleres the W3C trace context of ctx (traceparent, tracestate: the
// global OpenTelemetry propagator, see package tracing) merged with
// e.Headers, or NULL when there is neither. It returns an error wrapping
// ErrInvalid (naming the field) for an event that cannot be written, and the
// database error otherwise; either way nothing is written by this call.
// In ModeWAL it writes the event as a logical decoding message instead (the
// same members and headers, EncodeWAL) and returns an error wrapping
// ErrNoSlot while the outbox's slot is missing or invalidated.
func (o *Outbox) Enqueue(ctx context.Context, tx DBTX, e *Event) error {
	if err := o.checkMode(); err != nil {
		return err
	}
	payload, err := o.prepare(e)
	if err != nil {
		return err
	}
	headers, err := encodeHeaders(tracing.Headers(ctx), e.Headers)
	if err != nil {
		return fmt.Errorf("%s: %w", e.Type, err)
	}
	if o.cfg.Mode == ModeWAL {
		return o.emit(ctx, tx, []*Event{e}, [][]byte{payload}, []*string{headers})
	}
	if headers == nil {
		_, err = tx.Exec(ctx, o.insertOne, pgUUID(e.ID), e.Aggregate, e.AggregateID, e.Type, e.Version, string(payload))
	} else {
		_, err = tx.Exec(ctx, o.insertOneH, pgUUID(e.ID), e.Aggregate, e.AggregateID, e.Type, e.Version, string(payload), *headers)
	}
	if err != nil {
		return fmt.Errorf("outbox: insert %s: %w", e.Type, err)
	}
	return nil
}

// EnqueueBatch writes events inside tx in one statement and sets their IDs.
// Events of one aggregate keep their relative order; rows are inserted sorted
// by agregat_id so that concurrent batches take the per-aggregate locks in the
// same order and cannot deadlock each other. Every event gets the trace
// context of ctx merged with its own Headers, as with Enqueue. If any event
// is invalid, nothing is written. In ModeWAL the messages are written in the
// caller's order, in one statement.
func (o *Outbox) EnqueueBatch(ctx context.Context, tx DBTX, events []*Event) error {
	if len(events) == 0 {
		return nil
	}
	if err := o.checkMode(); err != nil {
		return err
	}
	if len(events) == 1 {
		return o.Enqueue(ctx, tx, events[0])
	}
	n := len(events)
	prepared := make([][]byte, n)
	traced := tracing.Headers(ctx)
	var headers []*string      // nil unless some event has capcaleres
	for i, e := range events { // in the caller's order: the error names the caller's index
		p, err := o.prepare(e)
		if err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
		prepared[i] = p
		h, err := encodeHeaders(traced, e.Headers)
		if err != nil {
			return fmt.Errorf("event %d: %s: %w", i, e.Type, err)
		}
		if h != nil && headers == nil {
			headers = make([]*string, n)
		}
		if h != nil {
			headers[i] = h
		}
	}
	if o.cfg.Mode == ModeWAL {
		return o.emit(ctx, tx, events, prepared, headers)
	}
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return strings.Compare(events[a].AggregateID, events[b].AggregateID) })
	ids, aggs, aggIDs, types := make([]pgtype.UUID, n), make([]string, n), make([]string, n), make([]string, n)
	versions, payloads := make([]int32, n), make([]string, n)
	for i, k := range order {
		e := events[k]
		ids[i], aggs[i], aggIDs[i], types[i], versions[i], payloads[i] = pgUUID(e.ID), e.Aggregate, e.AggregateID, e.Type, int32(e.Version), string(prepared[k])
	}
	var err error
	if headers == nil {
		_, err = tx.Exec(ctx, o.insertBatch, ids, aggs, aggIDs, types, versions, payloads)
	} else {
		sorted := make([]*string, n)
		for i, k := range order {
			sorted[i] = headers[k]
		}
		_, err = tx.Exec(ctx, o.insertBatchH, ids, aggs, aggIDs, types, versions, payloads, sorted)
	}
	if err != nil {
		return fmt.Errorf("outbox: insert batch of %d: %w", n, err)
	}
	return nil
}

func (o *Outbox) checkMode() error {
	if o.cfg.Mode != ModeTable && o.cfg.Mode != ModeWAL {
		return fmt.Errorf("%w: outbox mode %q is neither %q nor %q", ErrInvalid, o.cfg.Mode, ModeTable, ModeWAL)
	}
	return nil
}

// pgUUID is id as pgx encodes it directly in binary; a uuid.UUID goes through
// driver.Valuer and a failed plan per value, which costs more than the rest
// of a large EnqueueBatch's encoding.
func pgUUID(id uuid.UUID) pgtype.UUID { return pgtype.UUID{Bytes: id, Valid: true} }

func (o *Outbox) prepare(e *Event) ([]byte, error) {
	switch {
	case e == nil:
		return nil, fmt.Errorf("%w: nil event", ErrInvalid)
	case e.Aggregate == "":
		return nil, fmt.Errorf("%w: agregat is empty", ErrInvalid)
	case e.AggregateID == "":
		return nil, fmt.Errorf("%w: agregat_id is empty", ErrInvalid)
	case e.Type == "":
		return nil, fmt.Errorf("%w: tipus is empty", ErrInvalid)
	case e.Version < 0:
		return nil, fmt.Errorf("%w: versio %d is not positive", ErrInvalid, e.Version)
	case e.Version > math.MaxInt32: // the column is INTEGER; EnqueueBatch would wrap it
		return nil, fmt.Errorf("%w: versio %d is over the column's limit of %d", ErrInvalid, e.Version, math.MaxInt32)
	}
	if e.Version == 0 {
		e.Version = 1
	}
	payload, err := marshalPayload(e.Payload)
	if err != nil {
		return nil, fmt.Errorf("%w: %s carrega: %v", ErrInvalid, e.Type, err)
	}
	if len(payload) > o.cfg.MaxPayloadBytes {
		return nil, fmt.Errorf("%w: %s carrega is %d bytes, over the limit of %d", ErrInvalid, e.Type, len(payload), o.cfg.MaxPayloadBytes)
	}
	if o.cfg.Validate != nil {
		if err := o.cfg.Validate(e.Type, e.Version, payload); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
	}
	if e.ID == uuid.Nil {
		id, err := uuid.NewV7()
		if err != nil {
			return nil, fmt.Errorf("outbox: new id: %w", err)
		}
		e.ID = id
	}
	return payload, nil
}

func marshalPayload(p any) ([]byte, error) {
	var b []byte
	switch v := p.(type) {
	case nil:
		return nil, errors.New("missing")
	case json.RawMessage:
		b = v
	case []byte:
		b = v
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			return nil, err
		}
	}
	if !json.Valid(b) {
		return nil, errors.New("not valid JSON")
	}
	if t := strings.TrimLeft(string(b[:min(len(b), 64)]), " \t\r\n"); t == "" || t[0] != '{' {
		return nil, errors.New("must be a JSON object")
	}
	return b, nil
}

// Row is one outbox row as the relay reads it.
type Row struct {
	ID          uuid.UUID
	Aggregate   string
	AggregateID string
	Type        string
	Version     int
	Payload     []byte // carrega, JSON
	CreatedAt   time.Time
	// Headers is the decoded capcaleres (DecodeHeaders): extra headers to
	// publish with the event, appended after the contract's with
	// AppendHeaders. nil when the column is NULL. Both relays (polling and
	// CDC) fill it.
	Headers map[string]string
}

// Envelope returns the wire envelope of the row: id_esdeveniment = row id,
// data_ms = creat_en, origen = origin, dades = carrega.
func (r *Row) Envelope(origin string) *envelope.Envelope {
	return &envelope.Envelope{
		ID:      r.ID.String(),
		Type:    r.Type,
		Version: r.Version,
		TimeMS:  r.CreatedAt.UnixMilli(),
		Origin:  origin,
		Data:    r.Payload,
	}
}
