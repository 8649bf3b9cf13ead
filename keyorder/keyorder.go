// Package keyorder is the durable store of per-key order (a sequenced
// dead-letter queue): while a key's head message waits for a retry or sits in
// the dead-letter queue, the later messages of that key are parked here in
// arrival order instead of being applied, and are released in that order when
// the head succeeds. Other keys never wait: a healthy batch costs one indexed
// query (IsBlocked).
//
// Every write takes the caller's transaction (a pgx.Tx), so it commits or
// rolls back with the transaction that settles the message's offset or ack or
// applies its effect: a crash between parking and commit, or between release
// and apply, loses nothing and applies nothing twice.
//
// # How a consumer uses it (per message m of key k, in partition order)
//
//  1. Duplicate check (the inbox) first: an applied message is never parked.
//  2. heads := IsBlocked(tx, consumidor, keys of the batch) — no locks taken.
//  3. k not in heads: apply m. If m fails and will be retried (or is
//     dead-lettered), MarkHeadBlocked(tx, consumidor, k, Head{m.ID, …}) in the
//     transaction that settles m, committed before the retry copy is produced;
//     later messages of k in the same batch are parked behind it.
//  4. heads[k].MessageID == m.ID (m is the head's retry copy or its replay from
//     the DLQ): apply m; on success drain the key with ReleaseNext (or Release)
//     in the same transaction and apply each released message in order; a
//     released message that fails becomes the head (MarkHeadBlocked), the rest
//     stay parked behind it.
//  5. otherwise: Park(tx, consumidor, k, m) and settle m without applying it
//     and without recording its inbox key. ErrNotBlocked means the head was
//     released meanwhile: apply m.
//  6. When the head is dead-lettered: MarkHeadBlocked with ReasonDeadLettered
//     and its letter id, then DeadLetterBehind, which returns the parked
//     messages the consumer must copy to the DLQ as blocked by the head
//     (Config.Behind = DeadLetterBlocked) or nothing (StayParked).
//  7. A dead-lettered head that can never succeed is skipped by an operator
//     (Skip, through dlq.SkipSequence): the first message parked behind it
//     becomes the head and its dead letter is replayed, which is step 4.
//
// # Lock order
//
// A transaction takes (1) its inbox keys (sorted, by the consumer), (2) the
// claus_bloquejades rows it parks behind, releases or marks, one per key, in
// key order (the bulk calls sort; a caller touching several keys calls the
// single-key ones in key order), (3) the rows of the effect. IsBlocked and the
// readers take no locks. Two workers that both hold a message of one key (a
// retry copy of the head and a later message from the main topic) serialise on
// the key's row: Park waits for a Release in flight and then sees the key
// unblocked (ErrNotBlocked), never a block that no longer exists.
package keyorder

import (
	"cmp"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/migrate"
)

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations creates claus_bloquejades and missatges_aparcats in the schema of
// migrate.Names (default public), beside missatges_processats. Apply it with
// migrate.Up together with migrate.Inbox.
var Migrations = migrate.Set{Name: "ordre_per_clau", FS: sqlFS, Dir: "sql"}

// DBTX is what the operations need: a pgx.Tx for the writes (they must run in
// the caller's transaction), a pool, a connection or a transaction for the
// readers.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Reason says why a key's head blocks it.
type Reason string

// Reasons (claus_bloquejades.motiu).
const (
	ReasonRetry        Reason = "reintent" // the head waits for a retry
	ReasonDeadLettered Reason = "dlq"      // the head is in the dead-letter queue
)

// State is the estat of a parked message.
type State string

// States (missatges_aparcats.estat).
const (
	BehindRetry        State = "darrere_reintent"   // parked behind a head that waits for a retry
	BehindDeadLetter   State = "darrere_dlq"        // parked behind a dead-lettered head
	DeadLetteredBehind State = "morta_per_bloqueig" // dead-lettered as blocked by the head; still kept for the replay
)

// Policy chooses what happens to the messages behind a dead-lettered head.
type Policy int

const (
	// DeadLetterBlocked (the default): DeadLetterBehind returns them so that
	// the consumer copies each to the DLQ as blocked by the head (an operator
	// sees the whole sequence), and they stay here, so replaying the head still
	// releases them in order.
	DeadLetterBlocked Policy = iota
	// StayParked: they wait here, parked, until the head is replayed.
	StayParked
)

// Header is one record header (same fields as transport.Header, so a
// conversion is enough).
type Header struct {
	Key   string
	Value string
}

// Message is what is kept of a parked message to apply or dead-letter it later.
type Message struct {
	ID        string    // id_esdeveniment: the inbox key once applied; unique per consumidor here
	Topic     string    // domain topic (Kafka) or work queue (RabbitMQ)
	Partition int32     // Kafka partition, RabbitMQ shard
	Offset    int64     // Kafka offset; -1 on RabbitMQ
	Value     []byte    // the record value (the encoded envelope)
	Headers   []Header  // in record order, repeats kept
	Timestamp time.Time // the record's time (data_original); zero if unknown
}

// Parked is a message parked behind its key's head.
type Parked struct {
	Key      string
	Seq      int64 // arrival order within the key, from 1
	State    State
	ParkedAt time.Time
	Message
}

// Head is the message that blocks a key.
type Head struct {
	MessageID string // its id_esdeveniment; a message with this id is the head, not parked
	Reason    Reason
	LetterID  string // its dead letter's id when Reason is ReasonDeadLettered
	LastError string // why it failed (clipped to 200 bytes)
	Since     time.Time
}

// Sequence is a blocked key as `km0 dlq` and the console show it: the head
// and the messages behind it, in order.
type Sequence struct {
	Consumer string
	Key      string
	Head     Head
	Behind   []Parked
}

// Errors.
var (
	// ErrNotBlocked: Park on a key that has no blocked head (it was released
	// in a transaction that committed first). Apply the message instead.
	ErrNotBlocked = errors.New("keyorder: key is not blocked")
	// ErrNotHead: Release, ReleaseNext or DeadLetterBehind named a head that is
	// not the key's (a stale retry copy, or the key is not blocked). Nothing
	// changed.
	ErrNotHead = errors.New("keyorder: message is not the key's head")
	// ErrInput: an empty consumidor, key or message id, or text PostgreSQL
	// cannot store. Nothing changed.
	ErrInput = errors.New("keyorder: bad input")
)

// Config configures a Store. The zero value uses schema public and
// DeadLetterBlocked.
type Config struct {
	Schema string // default "public"; quoted, never spliced raw
	Behind Policy // what DeadLetterBehind does; default DeadLetterBlocked
}

// Store runs the operations. It holds no state besides the SQL and is safe for
// concurrent use.
type Store struct {
	behind Policy
	q      queries
}

type queries struct {
	blocked, mark, bump, park, parkedOne, lockHead, deleteHead, takeAll, takeNext, promote,
	markBehind, deadBehind, sequence, sequences, setLetter, lockDead, dropParked, skipTo string
}

// New returns a Store for cfg.
func New(cfg Config) (*Store, error) {
	if cfg.Schema == "" {
		cfg.Schema = migrate.SchemaDefault
	}
	if cfg.Behind != DeadLetterBlocked && cfg.Behind != StayParked {
		return nil, fmt.Errorf("keyorder: unknown Behind policy %d", cfg.Behind)
	}
	b := pgx.Identifier{cfg.Schema, "claus_bloquejades"}.Sanitize()
	p := pgx.Identifier{cfg.Schema, "missatges_aparcats"}.Sanitize()
	const cols = `clau, sequencia, estat, aparcat_en, id_missatge, topic, particio, offset_original, valor, capcaleres, data_original`
	return &Store{behind: cfg.Behind, q: queries{
		blocked: `SELECT clau, id_missatge, motiu, coalesce(id_carta, ''), coalesce(ultim_error, ''), bloquejada_en FROM ` + b +
			` WHERE consumidor = $1 AND clau = ANY($2::bytea[])`,
		mark: `INSERT INTO ` + b + ` AS b (consumidor, clau, id_missatge, motiu, id_carta, ultim_error) VALUES ($1, $2, $3, $4, nullif($5, ''), nullif($6, ''))
			ON CONFLICT (consumidor, clau) DO UPDATE SET id_missatge = EXCLUDED.id_missatge, motiu = EXCLUDED.motiu,
			id_carta = EXCLUDED.id_carta, ultim_error = EXCLUDED.ultim_error, bloquejada_en = now()`,
		bump:       `UPDATE ` + b + ` SET seguent = seguent + 1 WHERE consumidor = $1 AND clau = $2 RETURNING seguent - 1, motiu`,
		park:       `INSERT INTO ` + p + ` (consumidor, clau, sequencia, id_missatge, estat, topic, particio, offset_original, valor, capcaleres, data_original) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT (consumidor, id_missatge) DO NOTHING RETURNING aparcat_en`,
		parkedOne:  `SELECT ` + cols + ` FROM ` + p + ` WHERE consumidor = $1 AND id_missatge = $2`,
		lockHead:   `SELECT 1 FROM ` + b + ` WHERE consumidor = $1 AND clau = $2 AND id_missatge = $3 FOR UPDATE`,
		deleteHead: `DELETE FROM ` + b + ` WHERE consumidor = $1 AND clau = $2 AND id_missatge = $3`,
		takeAll:    `DELETE FROM ` + p + ` WHERE consumidor = $1 AND clau = $2 RETURNING ` + cols,
		takeNext: `DELETE FROM ` + p + ` WHERE (consumidor, clau, sequencia) = (SELECT consumidor, clau, sequencia FROM ` + p +
			` WHERE consumidor = $1 AND clau = $2 ORDER BY sequencia LIMIT 1) RETURNING ` + cols,
		promote:    `UPDATE ` + b + ` SET id_missatge = $3 WHERE consumidor = $1 AND clau = $2`,
		markBehind: `UPDATE ` + p + ` SET estat = $3 WHERE consumidor = $1 AND clau = $2 AND estat = 'darrere_reintent'`,
		deadBehind: `UPDATE ` + p + ` SET estat = 'morta_per_bloqueig' WHERE consumidor = $1 AND clau = $2 AND estat <> 'morta_per_bloqueig' RETURNING ` + cols,
		sequence:   `SELECT ` + cols + ` FROM ` + p + ` WHERE consumidor = $1 AND clau = $2 ORDER BY sequencia`,
		sequences:  `SELECT clau FROM ` + b + ` WHERE consumidor = $1 AND clau > $2 ORDER BY clau LIMIT $3`,
		setLetter: `UPDATE ` + b + ` SET id_carta = $4 WHERE consumidor = $1 AND clau = $2 AND id_missatge = $3
			AND motiu = 'dlq' AND id_carta IS DISTINCT FROM $4`,
		lockDead:   `SELECT motiu FROM ` + b + ` WHERE consumidor = $1 AND clau = $2 AND id_missatge = $3 FOR UPDATE`,
		dropParked: `DELETE FROM ` + p + ` WHERE consumidor = $1 AND clau = $2 AND id_missatge = $3`,
		skipTo: `UPDATE ` + b + ` SET id_missatge = $3, motiu = 'dlq', id_carta = nullif($4, ''), ultim_error = $5, bloquejada_en = now()
			WHERE consumidor = $1 AND clau = $2`,
	}}, nil
}

// IsBlocked returns the heads of the keys (of one batch) that are blocked; a
// key absent from the map is healthy. It is one indexed query whatever the
// number of keys and takes no locks (see the package doc for why that is
// enough: a key becomes blocked only in the worker that handles its messages,
// and Park re-checks under the key's lock).
func (s *Store) IsBlocked(ctx context.Context, db DBTX, consumer string, keys ...string) (map[string]Head, error) {
	if err := checkText("consumidor", consumer); err != nil {
		return nil, err
	}
	if len(keys) == 0 {
		return map[string]Head{}, nil
	}
	bs := make([][]byte, len(keys))
	for i, k := range keys {
		bs[i] = []byte(k)
	}
	rows, err := db.Query(ctx, s.q.blocked, consumer, bs)
	if err != nil {
		return nil, fmt.Errorf("keyorder: is blocked: %w", err)
	}
	out := map[string]Head{}
	var (
		k []byte
		h Head
	)
	_, err = pgx.ForEachRow(rows, []any{&k, &h.MessageID, &h.Reason, &h.LetterID, &h.LastError, &h.Since}, func() error {
		out[string(k)] = h
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("keyorder: is blocked: %w", err)
	}
	return out, nil
}

// MarkHeadBlocked records h as the head that blocks key: the message failed
// and waits for a retry (ReasonRetry) or was dead-lettered (ReasonDeadLettered,
// with h.LetterID). It creates the key's row or replaces its head (a released
// message that failed becomes the new head; the messages parked behind keep
// their place) and locks it until tx ends. With ReasonDeadLettered the parked
// messages that waited behind a retry now wait behind a dead letter; call
// DeadLetterBehind to apply the Config.Behind policy.
func (s *Store) MarkHeadBlocked(ctx context.Context, tx pgx.Tx, consumer, key string, h Head) error {
	if err := checkAll(consumer, key, h.MessageID); err != nil {
		return err
	}
	if h.Reason != ReasonRetry && h.Reason != ReasonDeadLettered {
		return fmt.Errorf("%w: reason %q", ErrInput, h.Reason)
	}
	if _, err := tx.Exec(ctx, s.q.mark, consumer, []byte(key), h.MessageID, string(h.Reason), h.LetterID, clip(h.LastError)); err != nil {
		return fmt.Errorf("keyorder: mark head: %w", err)
	}
	if h.Reason == ReasonDeadLettered {
		if _, err := tx.Exec(ctx, s.q.markBehind, consumer, []byte(key), string(BehindDeadLetter)); err != nil {
			return fmt.Errorf("keyorder: mark head: %w", err)
		}
	}
	return nil
}

// Park parks m behind key's head, after the messages parked before it, and
// returns it with its sequence and state. It locks the key's row first; if
// the key is not blocked (any more) it returns ErrNotBlocked and changes
// nothing: apply m instead. A message already parked (a redelivery, or its
// dead letter replayed on its own while the head still blocks) is returned as
// it is, with dup true: it keeps its place and is not parked twice. Behind a
// dead-lettered head m is parked DeadLetteredBehind under DeadLetterBlocked
// (copy it to the DLQ) or BehindDeadLetter under StayParked.
func (s *Store) Park(ctx context.Context, tx pgx.Tx, consumer, key string, m Message) (p Parked, dup bool, err error) {
	if err := checkAll(consumer, key, m.ID); err != nil {
		return Parked{}, false, err
	}
	if err := checkText("topic", m.Topic); err != nil {
		return Parked{}, false, err
	}
	var (
		seq    int64
		reason string
	)
	err = tx.QueryRow(ctx, s.q.bump, consumer, []byte(key)).Scan(&seq, &reason)
	if errors.Is(err, pgx.ErrNoRows) {
		return Parked{}, false, ErrNotBlocked
	}
	if err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: park: %w", err)
	}
	state := BehindRetry
	if Reason(reason) == ReasonDeadLettered {
		state = BehindDeadLetter
		if s.behind == DeadLetterBlocked {
			state = DeadLetteredBehind
		}
	}
	hs, err := encodeHeaders(m.Headers)
	if err != nil {
		return Parked{}, false, err
	}
	var ts *time.Time
	if !m.Timestamp.IsZero() {
		ts = &m.Timestamp
	}
	p = Parked{Key: key, Seq: seq, State: state, Message: m}
	err = tx.QueryRow(ctx, s.q.park, consumer, []byte(key), seq, m.ID, string(state), m.Topic, m.Partition, m.Offset,
		nonNil(m.Value), hs, ts).Scan(&p.ParkedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		rows, err := tx.Query(ctx, s.q.parkedOne, consumer, m.ID)
		if err != nil {
			return Parked{}, false, fmt.Errorf("keyorder: park: %w", err)
		}
		got, err := collect(rows)
		if err != nil || len(got) != 1 {
			return Parked{}, false, fmt.Errorf("keyorder: park: read the parked copy of %s: %d rows, %v", m.ID, len(got), err)
		}
		return got[0], true, nil
	}
	if err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: park: %w", err)
	}
	return p, false, nil
}

// Release unblocks key after its head (headID) succeeded in tx, and returns
// every message parked behind it, in order, removed from the store: apply
// them in that order in the same transaction (a rollback puts everything
// back). Messages dead-lettered as blocked are released too: replaying the
// head releases the whole sequence. ErrNotHead if headID is not key's head.
func (s *Store) Release(ctx context.Context, tx pgx.Tx, consumer, key, headID string) ([]Parked, error) {
	if err := checkAll(consumer, key, headID); err != nil {
		return nil, err
	}
	tag, err := tx.Exec(ctx, s.q.deleteHead, consumer, []byte(key), headID)
	if err != nil {
		return nil, fmt.Errorf("keyorder: release: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return nil, ErrNotHead
	}
	rows, err := tx.Query(ctx, s.q.takeAll, consumer, []byte(key))
	if err != nil {
		return nil, fmt.Errorf("keyorder: release: %w", err)
	}
	ps, err := collect(rows)
	if err != nil {
		return nil, fmt.Errorf("keyorder: release: %w", err)
	}
	slices.SortFunc(ps, func(a, b Parked) int { return cmp.Compare(a.Seq, b.Seq) })
	return ps, nil
}

// ReleaseNext releases one message at a time after headID succeeded: it
// removes the first message parked behind key and makes it the head (so the
// key stays blocked, and locked, while it is applied), and returns it with ok
// true. When nothing is parked it unblocks key and returns ok false. Call it
// again with the returned message's ID after applying it; if that message
// fails, MarkHeadBlocked it instead: the rest stay parked behind it. All in one
// transaction. ErrNotHead if headID is not key's head.
func (s *Store) ReleaseNext(ctx context.Context, tx pgx.Tx, consumer, key, headID string) (p Parked, ok bool, err error) {
	if err := checkAll(consumer, key, headID); err != nil {
		return Parked{}, false, err
	}
	var one int
	err = tx.QueryRow(ctx, s.q.lockHead, consumer, []byte(key), headID).Scan(&one)
	if errors.Is(err, pgx.ErrNoRows) {
		return Parked{}, false, ErrNotHead
	}
	if err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: release next: %w", err)
	}
	rows, err := tx.Query(ctx, s.q.takeNext, consumer, []byte(key))
	if err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: release next: %w", err)
	}
	ps, err := collect(rows)
	if err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: release next: %w", err)
	}
	if len(ps) == 0 {
		if _, err := tx.Exec(ctx, s.q.deleteHead, consumer, []byte(key), headID); err != nil {
			return Parked{}, false, fmt.Errorf("keyorder: release next: %w", err)
		}
		return Parked{}, false, nil
	}
	if _, err := tx.Exec(ctx, s.q.promote, consumer, []byte(key), ps[0].ID); err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: release next: %w", err)
	}
	return ps[0], true, nil
}

// DeadLetterBehind applies the Config.Behind policy to the messages parked
// behind key's dead-lettered head (MarkHeadBlocked with ReasonDeadLettered
// first, in the same transaction). Under DeadLetterBlocked it marks each not
// yet dead-lettered one DeadLetteredBehind and returns them in order: copy
// each to the DLQ with a motiu naming the head (BlockedReason). They stay in
// the store, so replaying the head still releases them in order. Under
// StayParked it returns nothing. ErrNotHead if headID is not key's head.
func (s *Store) DeadLetterBehind(ctx context.Context, tx pgx.Tx, consumer, key, headID string) ([]Parked, error) {
	if err := checkAll(consumer, key, headID); err != nil {
		return nil, err
	}
	var one int
	err := tx.QueryRow(ctx, s.q.lockHead, consumer, []byte(key), headID).Scan(&one)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotHead
	}
	if err != nil {
		return nil, fmt.Errorf("keyorder: dead-letter behind: %w", err)
	}
	if s.behind == StayParked {
		return nil, nil
	}
	rows, err := tx.Query(ctx, s.q.deadBehind, consumer, []byte(key))
	if err != nil {
		return nil, fmt.Errorf("keyorder: dead-letter behind: %w", err)
	}
	ps, err := collect(rows)
	if err != nil {
		return nil, fmt.Errorf("keyorder: dead-letter behind: %w", err)
	}
	slices.SortFunc(ps, func(a, b Parked) int { return cmp.Compare(a.Seq, b.Seq) })
	return ps, nil
}

// ErrNotDeadLettered: Skip named a head that waits for a retry. Only a
// dead-lettered head can be skipped: a retry copy on its way could still be
// applied. Nothing changed.
var ErrNotDeadLettered = errors.New("keyorder: the head is not dead-lettered")

// Skip gives up on key's dead-lettered head headID in tx, for an operator
// who found it can never succeed: the head is not applied (its own stored
// row, if it is a released message that had failed, is deleted), and the
// first message parked behind it becomes the head, dead-lettered, with
// letterID (its dead letter, "" if unknown) and its row kept, so that
// replaying that letter makes its consumer apply it and release the rest in
// order (step 4 of the package doc). It returns that message with ok true;
// with nothing parked it unblocks key and returns ok false. ErrNotHead if
// headID is not key's head, ErrNotDeadLettered if it waits for a retry.
func (s *Store) Skip(ctx context.Context, tx pgx.Tx, consumer, key, headID, letterID string) (next Parked, ok bool, err error) {
	if err := checkAll(consumer, key, headID); err != nil {
		return Parked{}, false, err
	}
	var reason string
	err = tx.QueryRow(ctx, s.q.lockDead, consumer, []byte(key), headID).Scan(&reason)
	if errors.Is(err, pgx.ErrNoRows) {
		return Parked{}, false, ErrNotHead
	}
	if err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: skip: %w", err)
	}
	if Reason(reason) != ReasonDeadLettered {
		return Parked{}, false, fmt.Errorf("%w: %s waits for a retry", ErrNotDeadLettered, headID)
	}
	if _, err := tx.Exec(ctx, s.q.dropParked, consumer, []byte(key), headID); err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: skip: %w", err)
	}
	rows, err := tx.Query(ctx, s.q.sequence, consumer, []byte(key))
	if err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: skip: %w", err)
	}
	ps, err := collect(rows)
	if err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: skip: %w", err)
	}
	if len(ps) == 0 {
		if _, err := tx.Exec(ctx, s.q.deleteHead, consumer, []byte(key), headID); err != nil {
			return Parked{}, false, fmt.Errorf("keyorder: skip: %w", err)
		}
		return Parked{}, false, nil
	}
	next = ps[0]
	if _, err := tx.Exec(ctx, s.q.skipTo, consumer, []byte(key), next.ID, letterID,
		clip("the head before it ("+headID+") was skipped: replay this message's dead letter")); err != nil {
		return Parked{}, false, fmt.Errorf("keyorder: skip: %w", err)
	}
	return next, true, nil
}

// BlockedReason is the motiu of a message dead-lettered as blocked by its
// key's head: permanent (replaying it alone re-parks it; replay the head).
func BlockedReason(headID string) string {
	return clip(contract.ReasonBlockedBy + headID)
}

// Sequence returns key's head and the messages behind it, in order, for
// `km0 dlq` and the console; ok false when key is not blocked. It takes no
// locks: run it in a REPEATABLE READ transaction for a consistent picture.
func (s *Store) Sequence(ctx context.Context, db DBTX, consumer, key string) (seq Sequence, ok bool, err error) {
	heads, err := s.IsBlocked(ctx, db, consumer, key)
	if err != nil {
		return Sequence{}, false, err
	}
	h, ok := heads[key]
	if !ok {
		return Sequence{}, false, nil
	}
	rows, err := db.Query(ctx, s.q.sequence, consumer, []byte(key))
	if err != nil {
		return Sequence{}, false, fmt.Errorf("keyorder: sequence: %w", err)
	}
	ps, err := collect(rows)
	if err != nil {
		return Sequence{}, false, fmt.Errorf("keyorder: sequence: %w", err)
	}
	return Sequence{Consumer: consumer, Key: key, Head: h, Behind: ps}, true, nil
}

// SetLetter records letterID as the dead letter of key's head headID
// (claus_bloquejades.id_carta). The consumer cannot: a letter's ID is its
// DLQ position, known only once the copy is on the broker, after the
// transaction that blocked the key. The DLQ index sets it when it reads the
// sequence (dlq.KeySequence). It changes nothing when headID is no longer
// the head, or the head waits for a retry; it is one statement, so db may be
// a pool.
func (s *Store) SetLetter(ctx context.Context, db DBTX, consumer, key, headID, letterID string) error {
	if err := checkAll(consumer, key, headID); err != nil {
		return err
	}
	if _, err := db.Exec(ctx, s.q.setLetter, consumer, []byte(key), headID, letterID); err != nil {
		return fmt.Errorf("keyorder: set letter: %w", err)
	}
	return nil
}

// BlockedKeys lists up to limit blocked keys of consumer after the key after
// ("" from the first), in key order: the pages of `km0 dlq`'s and the
// console's list of sequences.
func (s *Store) BlockedKeys(ctx context.Context, db DBTX, consumer, after string, limit int) ([]string, error) {
	if err := checkText("consumidor", consumer); err != nil {
		return nil, err
	}
	if limit <= 0 {
		limit = 100
	}
	rows, err := db.Query(ctx, s.q.sequences, consumer, []byte(after), limit)
	if err != nil {
		return nil, fmt.Errorf("keyorder: blocked keys: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var k []byte
		err := r.Scan(&k)
		return string(k), err
	})
}

func collect(rows pgx.Rows) ([]Parked, error) {
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Parked, error) {
		var (
			p  Parked
			k  []byte
			hs []byte
			ts *time.Time
		)
		if err := r.Scan(&k, &p.Seq, &p.State, &p.ParkedAt, &p.ID, &p.Topic, &p.Partition, &p.Offset, &p.Value, &hs, &ts); err != nil {
			return Parked{}, err
		}
		p.Key = string(k)
		if ts != nil {
			p.Timestamp = *ts
		}
		var pairs [][2]string
		if err := json.Unmarshal(hs, &pairs); err != nil {
			return Parked{}, fmt.Errorf("headers of %s: %w", p.ID, err)
		}
		for _, kv := range pairs {
			p.Headers = append(p.Headers, Header{Key: kv[0], Value: kv[1]})
		}
		return p, nil
	})
}

// encodeHeaders stores headers as a JSON array of [name, value] pairs. JSONB
// text cannot hold NUL or invalid UTF-8: such a header is refused (ErrInput)
// rather than altered.
func encodeHeaders(hs []Header) ([]byte, error) {
	pairs := make([][2]string, len(hs))
	for i, h := range hs {
		if !storable(h.Key) || !storable(h.Value) {
			return nil, fmt.Errorf("%w: header %d holds a NUL byte or invalid UTF-8", ErrInput, i)
		}
		pairs[i] = [2]string{h.Key, h.Value}
	}
	return json.Marshal(pairs)
}

func checkAll(consumer, key, id string) error {
	if err := checkText("consumidor", consumer); err != nil {
		return err
	}
	if key == "" {
		return fmt.Errorf("%w: empty key (a message without a key has no order to keep)", ErrInput)
	}
	return checkText("id_missatge", id)
}

func checkText(what, s string) error {
	if s == "" {
		return fmt.Errorf("%w: empty %s", ErrInput, what)
	}
	if !storable(s) {
		return fmt.Errorf("%w: %s holds a NUL byte or invalid UTF-8", ErrInput, what)
	}
	return nil
}

func storable(s string) bool { return strings.IndexByte(s, 0) < 0 && utf8.ValidString(s) }

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// clip cuts s to at most 200 bytes on a rune boundary (the contract's limit
// for ultim_error and motiu).
func clip(s string) string {
	if len(s) <= 200 {
		return s
	}
	i := 200
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i]
}
