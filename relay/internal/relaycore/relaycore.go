// Package relaycore is what the polling relay (package relay) and the CDC
// relay (package relay/cdc) share, so that both publish the same records of
// an outbox row, park the same way and exclude each other. It is internal:
// none of it is API of either relay.
package relaycore

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport"
)

// DB is where a relay's sessions go: the relay Config's Pool, DatabaseURL
// and ApplicationName.
type DB struct {
	Pool            *pgxpool.Pool
	DatabaseURL     string
	ApplicationName string
}

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
// errConfig (the relay's ErrConfig) that does not show it (it may hold a
// password).
func Sessions(cfg DB, maxConns int32, errConfig error) (pool *pgxpool.Pool, owned bool, conn *pgx.ConnConfig, err error) {
	if cfg.Pool != nil {
		pool, conn = cfg.Pool, cfg.Pool.Config().ConnConfig.Copy()
	} else {
		pc, err := pgxpool.ParseConfig(cfg.DatabaseURL)
		if err != nil {
			return nil, false, nil, fmt.Errorf("%w: DatabaseURL does not parse (not shown: it may hold a password)", errConfig)
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

// Encoder builds the broker records of outbox rows, the same for both
// relays.
type Encoder struct{ cfg EncoderConfig }

// EncoderConfig is what an Encoder takes of a relay's Config (with its
// defaults applied).
type EncoderConfig struct {
	Topic          string
	Origin         string
	Transform      func(row *outbox.Row, env *envelope.Envelope) ([]*envelope.Envelope, error)
	MaxRecordBytes int
	Publisher      transport.Publisher // its transport.Checker, if any, refuses records
}

// NewEncoder returns the Encoder of cfg.
func NewEncoder(cfg EncoderConfig) *Encoder { return &Encoder{cfg: cfg} }

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
			return nil, Clip("transform: " + err.Error())
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
			return nil, Clip("envelope: " + err.Error())
		}
		m := &transport.Message{Topic: enc.cfg.Topic, Key: key, Value: value, Headers: []transport.Header{
			{Key: contract.HeaderType, Value: e.Type}, {Key: contract.HeaderEventID, Value: e.ID}}}
		if c := correlation(e); c != "" {
			m.Headers = append(m.Headers, transport.Header{Key: contract.HeaderCorrelator, Value: c})
		}
		m.Headers = outbox.AppendHeaders(m.Headers, row.Headers) // capcaleres, never over the contract's
		if RecordSize(m) > enc.cfg.MaxRecordBytes {
			// JSONB comes back with a space after every ',' and ':', up to
			// half again the size the outbox accepted: compact it before
			// judging the record too large.
			var buf bytes.Buffer
			if json.Compact(&buf, e.Data) == nil && buf.Len() < len(e.Data) {
				c := *e
				c.Data = buf.Bytes()
				if m.Value, err = c.Encode(); err != nil {
					return nil, Clip("envelope: " + err.Error())
				}
			}
		}
		if size := RecordSize(m); size > enc.cfg.MaxRecordBytes {
			return nil, fmt.Sprintf("record of %d bytes is over the relay's limit of %d (MaxRecordBytes)", size, enc.cfg.MaxRecordBytes)
		}
		if c, ok := enc.cfg.Publisher.(transport.Checker); ok {
			if err := c.Check(m); err != nil { // parked before a later row of its aggregate is sent
				return nil, Clip("broker: " + err.Error())
			}
		}
		out = append(out, m)
	}
	return out, ""
}

// MemberObjID is the low half of the advisory-lock key every polling relay
// worker holds in shared mode while it is connected: counting its holders
// counts the workers. Shard s uses low half s (0..63).
const MemberObjID = 1 << 16

// MemberLockKey is the session advisory lock (single-bigint form) every
// polling relay worker of names holds in shared mode while it is connected.
// A CDC relay of the same outbox holds it in exclusive mode while it streams,
// so the two kinds never publish the same table at the same time: each waits
// for the other to leave.
func MemberLockKey(names migrate.Names) int64 { return LockKey(LockSpace(names), MemberObjID) }

// ParkSQL is the statement that parks rows of names in <outbox>_aparcats:
// $1 ids uuid[], $2 agregat_ids text[], $3 reasons text[]. A row parked
// again gets the new reason.
func ParkSQL(names migrate.Names) string {
	n := names.WithDefaults()
	parked := pgx.Identifier{n.Schema, n.Outbox + "_aparcats"}.Sanitize()
	return "INSERT INTO " + parked + " (id, agregat_id, motiu) SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[])" +
		" ON CONFLICT (id) DO UPDATE SET motiu = EXCLUDED.motiu, aparcat_en = now()"
}

// MarkSQL is the statement that marks the confirmed rows of table (quoted)
// matching where: sets publicat_en, or with del deletes them
// (Config.DeletePublished).
func MarkSQL(table string, del bool, where string) string {
	if del {
		return "DELETE FROM " + table + " WHERE " + where
	}
	return "UPDATE " + table + " SET publicat_en = now() WHERE " + where
}

// LockSpace is the high half of the advisory-lock keys of one outbox table:
// relays of different tables never contend. The single-bigint lock form
// (objsubid 1 in pg_locks) keeps these keys apart from the per-aggregate
// two-integer locks of the outbox trigger (objsubid 2).
func LockSpace(n migrate.Names) uint32 {
	n = n.WithDefaults()
	h := fnv.New32a()
	_, _ = h.Write([]byte("km0.relay:" + n.Schema + "." + n.Outbox))
	return h.Sum32()
}

// LockKey is the bigint advisory-lock key of objID in space.
func LockKey(space uint32, objID uint32) int64 {
	return int64(uint64(space)<<32 | uint64(objID))
}

// correlation is the envelope's "correlacio" member (set on both copies of a
// dual-published pair), or "".
func correlation(e *envelope.Envelope) string {
	raw, ok := e.Extra[contract.HeaderCorrelator]
	if !ok {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return ""
	}
	return s
}

// RecordSize is the bytes of m a broker counts: key, value and headers.
func RecordSize(m *transport.Message) int {
	n := len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

// Clip makes s storable as motiu (TEXT): valid UTF-8 without NUL, cut on a
// character boundary after at most 500 bytes. A reason PostgreSQL refuses
// would fail the parking INSERT, and with it the whole batch, at every retry.
func Clip(s string) string {
	const n = 500
	s = strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
