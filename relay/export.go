package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport"
)

// The parts of the polling relay another relay of the same outbox (the CDC
// relay, package relay/cdc) shares with it, so that both publish the same
// records, park the same way and exclude each other.

// Sessions returns the pool a relay runs its statements on, cfg.Pool or a
// pool of at most maxConns opened on cfg.DatabaseURL (owned: the caller
// closes it), and the configuration of the sessions it opens itself, with
// application_name set, synchronous_commit off (a lost mark only republishes
// rows with the same ids: at-least-once, so the relay's own commits need not
// wait for the WAL flush) and jit off. A worker owning some of the shards
// filters the claim's index scan by shard, so the planner, which cannot tell
// that the LIMIT is reached early, costs the claim as a scan of every
// pending row: past jit_above_cost, and then each claim spent ~100 ms
// compiling for a scan of 2 ms. A relay's statements are small and run for
// ever: no JIT. A DatabaseURL that does not parse is an error wrapping
// ErrConfig that does not show it (it may hold a password).
func Sessions(cfg Config, maxConns int32) (pool *pgxpool.Pool, owned bool, conn *pgx.ConnConfig, err error) {
	if cfg.Pool != nil {
		pool, conn = cfg.Pool, cfg.Pool.Config().ConnConfig.Copy()
	} else {
		pc, err := pgxpool.ParseConfig(cfg.DatabaseURL)
		if err != nil {
			return nil, false, nil, fmt.Errorf("%w: DatabaseURL does not parse (not shown: it may hold a password)", ErrConfig)
		}
		pc.MaxConns = maxConns
		if pool, err = pgxpool.NewWithConfig(context.Background(), pc); err != nil {
			return nil, false, nil, fmt.Errorf("pool: %w", err)
		}
		owned, conn = true, pc.ConnConfig.Copy()
	}
	conn.RuntimeParams["application_name"] = cfg.ApplicationName
	conn.RuntimeParams["synchronous_commit"] = "off"
	conn.RuntimeParams["jit"] = "off"
	return pool, owned, conn, nil
}

// Encoder builds the broker records of outbox rows exactly as the relay does.
type Encoder struct{ cfg Config }

// NewEncoder returns the Encoder of cfg (with its defaults): it uses
// Topic, Origin, Transform, MaxRecordBytes and Publisher (for its
// transport.Checker).
func NewEncoder(cfg Config) *Encoder { return &Encoder{cfg: cfg.WithDefaults()} }

// Records returns the broker records of row, in order, or the reason to park
// it: a Transform error or an empty result, an envelope that does not
// encode, a record over MaxRecordBytes, or one the Publisher's
// transport.Checker refuses. Each record is keyed by agregat_id and carries
// the tipus and id_esdeveniment headers (and correlacio when the envelope has
// one), then row.Headers (capcaleres) in key order, except those that would
// replace the relay's own.
func (enc *Encoder) Records(row *outbox.Row) ([]*transport.Message, string) {
	env := row.Envelope(enc.cfg.Origin)
	envs := []*envelope.Envelope{env}
	if t := enc.cfg.Transform; t != nil {
		var err error
		if envs, err = t(row, env); err != nil {
			return nil, clip("transform: " + err.Error())
		}
		// No envelope is nothing for the broker to confirm: marking the
		// row would lose its event (CONTRACT 4).
		if len(envs) == 0 {
			return nil, "transform: returned no envelope"
		}
	}
	key := []byte(row.AggregateID)
	out := make([]*transport.Message, 0, len(envs))
	for _, e := range envs {
		if e == nil {
			return nil, "transform: returned a nil envelope"
		}
		value, err := e.Encode()
		if err != nil {
			return nil, clip("envelope: " + err.Error())
		}
		m := &transport.Message{Topic: enc.cfg.Topic, Key: key, Value: value, Headers: []transport.Header{
			{Key: contract.HeaderType, Value: e.Type}, {Key: contract.HeaderEventID, Value: e.ID}}}
		if c := correlation(e); c != "" {
			m.Headers = append(m.Headers, transport.Header{Key: contract.HeaderCorrelator, Value: c})
		}
		m.Headers = outbox.AppendHeaders(m.Headers, row.Headers) // capcaleres, never over the contract's
		if recordSize(m) > enc.cfg.MaxRecordBytes {
			// JSONB comes back with a space after every ',' and ':', up to
			// half again the size the outbox accepted: compact it before
			// judging the record too large.
			var buf bytes.Buffer
			if json.Compact(&buf, e.Data) == nil && buf.Len() < len(e.Data) {
				c := *e
				c.Data = buf.Bytes()
				if m.Value, err = c.Encode(); err != nil {
					return nil, clip("envelope: " + err.Error())
				}
			}
		}
		if size := recordSize(m); size > enc.cfg.MaxRecordBytes {
			return nil, fmt.Sprintf("record of %d bytes is over the relay's limit of %d (MaxRecordBytes)", size, enc.cfg.MaxRecordBytes)
		}
		if c, ok := enc.cfg.Publisher.(transport.Checker); ok {
			if err := c.Check(m); err != nil { // parked before a later row of its aggregate is sent
				return nil, clip("broker: " + err.Error())
			}
		}
		out = append(out, m)
	}
	return out, ""
}

// MemberLockKey is the session advisory lock (single-bigint form) every
// polling relay worker of names holds in shared mode while it is connected.
// A CDC relay of the same outbox holds it in exclusive mode while it streams,
// so the two kinds never publish the same table at the same time: each waits
// for the other to leave.
func MemberLockKey(names migrate.Names) int64 { return lockKey(lockSpace(names), memberObjID) }

// ParkSQL is the statement that parks rows of names in <outbox>_aparcats:
// $1 ids uuid[], $2 agregat_ids text[], $3 reasons text[]. A row parked
// again gets the new reason.
func ParkSQL(names migrate.Names) string { return newQueries(names, false).park }

// Clip makes s storable as a parking reason (valid UTF-8 without NUL, at
// most about 500 bytes).
func Clip(s string) string { return clip(s) }
