package dlq

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport"
)

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations is the migration set that creates the index table cartes_mortes
// (and its indexes) in the schema of the migrate.Names passed to migrate.Up.
// Like every set it is safe to apply twice and concurrently.
var Migrations = migrate.Set{Name: "dlq", FS: sqlFS, Dir: "sql"}

// table is the name of the index table.
const table = "cartes_mortes"

// ErrNotFound is returned by Get for an ID the index does not hold.
var ErrNotFound = errors.New("dlq: no such letter")

// DB is what Store needs: a *pgxpool.Pool or a *pgx.Conn.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// querier is a DB or a pgx.Tx.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Store is the PostgreSQL index of dead letters (table cartes_mortes, created
// by Migrations). It is safe for concurrent use.
type Store struct {
	db      DB
	table   string
	refused string // cartes_refusades
	audit   string // auditoria_cartes
	edits   string // cartes_editades
	// feines_reproduccio and its letters (job.go)
	jobs, jobLetters string
}

// NewStore returns a Store on db for the table in schema ("" = "public").
func NewStore(db DB, schema string) *Store {
	if schema == "" {
		schema = migrate.SchemaDefault
	}
	return &Store{db: db, table: pgx.Identifier{schema, table}.Sanitize(),
		refused:    pgx.Identifier{schema, RefusedTable}.Sanitize(),
		audit:      pgx.Identifier{schema, "auditoria_cartes"}.Sanitize(),
		edits:      pgx.Identifier{schema, "cartes_editades"}.Sanitize(),
		jobs:       pgx.Identifier{schema, "feines_reproduccio"}.Sanitize(),
		jobLetters: pgx.Identifier{schema, "feines_reproduccio_cartes"}.Sanitize()}
}

// Filter selects letters. The zero Filter selects every letter.
type Filter struct {
	// Topic is a DLQ topic ("x.dlq") or an original topic ("x"); "" = all.
	Topic string
	// Reason keeps letters whose motiu starts with it, e.g. "permanent: esquema".
	Reason string
	// Class keeps letters whose reason class (Letter.Class, the grouping of
	// Summary) is exactly this: one failure group, where a Reason prefix
	// would also match longer classes.
	Class string
	// Group keeps letters of this consumer (grup_consumidor: the Kafka
	// consumer group, or the RabbitMQ work queue); "" = every consumer.
	Group string
	// Since and Until bound the dead time (morta_en) to [Since, Until); zero = open.
	Since, Until time.Time
	// IDs, when not empty, keeps only these letters.
	IDs []string
	// EventIDs, when not empty, keeps only the letters of these events
	// (id_esdeveniment): a blocked key's head and the messages behind it.
	EventIDs []string
	// States, when not empty, keeps only letters in these states.
	States []State
	// NoGroup keeps only letters that name no consumer group (the
	// Group.Consumer NoConsumer of Summary). Empty ignores it: alone it
	// counts as no condition.
	NoGroup bool
	// Limit caps the rows List returns; 0 = no cap. Summary ignores it.
	Limit int
	// Fold makes List return one letter per event and consumer, with
	// Letter.Copies counting the duplicates. The
	// counts of Summary still count every letter. Replay and Purge
	// ignore it.
	Fold bool

	exclude []string // letters a Replay already handled
}

// Empty reports whether f selects every letter (no condition at all).
func (f Filter) Empty() bool {
	return f.Topic == "" && f.Reason == "" && f.Class == "" && f.Group == "" && f.Since.IsZero() && f.Until.IsZero() &&
		len(f.IDs) == 0 && len(f.EventIDs) == 0 && len(f.States) == 0
}

// where returns the WHERE clause of f (starting "WHERE", or "") and appends
// its arguments to args.
func (f Filter) where(args *[]any) string {
	var conds []string
	arg := func(v any) string {
		*args = append(*args, v)
		return "$" + strconv.Itoa(len(*args))
	}
	if f.Topic != "" {
		if strings.HasSuffix(f.Topic, contract.DLQSuffix) {
			conds = append(conds, "topic = "+arg(f.Topic))
		} else {
			conds = append(conds, "topic_original = "+arg(f.Topic))
		}
	}
	if f.Reason != "" {
		conds = append(conds, "motiu LIKE "+arg(likePrefix(f.Reason)))
	}
	if f.Class != "" {
		conds = append(conds, "classe_motiu = "+arg(f.Class))
	}
	if f.Group != "" {
		conds = append(conds, "grup_consumidor = "+arg(f.Group))
	}
	if !f.Since.IsZero() {
		conds = append(conds, "morta_en >= "+arg(f.Since))
	}
	if !f.Until.IsZero() {
		conds = append(conds, "morta_en < "+arg(f.Until))
	}
	if len(f.IDs) > 0 {
		conds = append(conds, "id = ANY("+arg(f.IDs)+")")
	}
	if len(f.EventIDs) > 0 {
		conds = append(conds, "id_esdeveniment = ANY("+arg(f.EventIDs)+")")
	}
	if f.NoGroup {
		conds = append(conds, "coalesce(grup_consumidor, '') = ''")
	}
	if len(f.exclude) > 0 {
		conds = append(conds, "NOT (id = ANY("+arg(f.exclude)+"))")
	}
	if len(f.States) > 0 {
		s := make([]string, len(f.States))
		for i, st := range f.States {
			s[i] = string(st)
		}
		conds = append(conds, "estat = ANY("+arg(s)+")")
	}
	if len(conds) == 0 {
		return ""
	}
	return "WHERE " + strings.Join(conds, " AND ")
}

// likePrefix escapes the LIKE metacharacters of p and appends '%'.
func likePrefix(p string) string {
	r := strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`)
	return r.Replace(p) + "%"
}

const columns = `id, topic, particio, offset_dlq, topic_original, particio_original, offset_original,
	id_esdeveniment, tipus, motiu, intents, primera_fallada, data_esdeveniment, morta_en,
	grup_consumidor, clau, valor, capcaleres_claus, capcaleres_valors, estat, reproduccions,
	reproduida_en, purgada_en, temps_desconegut`

// Insert indexes letters in one transaction and returns those that were new.
// A letter already indexed (same ID) is left as it is, state included.
//
// Each letter is first bounded to the columns, in place: intents clamped to
// [0, 2^31-1], text made storable and cut to MaxIndexedText (the headers
// stay whole). A letter PostgreSQL still refuses for what it holds (a data
// exception, a program limit, an integrity violation) is set aside in
// cartes_refusades (Refused) and not returned, so the others are indexed;
// any other error (the database unavailable) fails the whole call, and
// indexing the same letters again is safe.
func (s *Store) Insert(ctx context.Context, letters []*Letter) ([]*Letter, error) {
	res, err := s.insert(ctx, letters)
	return res.added, err
}

// Index is Insert for a Backend's Sync: it returns the letters set aside
// for the first time too (SyncResult.Refused), whose alerts Service.Sync
// raises.
func (s *Store) Index(ctx context.Context, letters []*Letter) (added []*Letter, refused []Refusal, err error) {
	res, err := s.insert(ctx, letters)
	return res.added, res.refused, err
}

// insert is Insert, reporting the letters set aside too.
func (s *Store) insert(ctx context.Context, letters []*Letter) (inserted, error) {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return inserted{}, fmt.Errorf("dlq: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	res, err := s.insertTx(ctx, tx, letters)
	if err != nil {
		return inserted{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return inserted{}, fmt.Errorf("dlq: commit: %w", err)
	}
	return res, nil
}

// insertBatch inserts letters, already bounded, in one pipeline.
func (s *Store) insertBatch(ctx context.Context, tx pgx.Tx, letters []*Letter) ([]*Letter, error) {
	q := `INSERT INTO ` + s.table + ` (` + columns + `, classe_motiu)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19,
		        'pendent', 0, NULL, NULL, $20, $21)
		ON CONFLICT (id) DO NOTHING RETURNING true`
	b := &pgx.Batch{}
	for _, l := range letters {
		keys, vals := headerBytes(l.Headers)
		b.Queue(q, l.ID, pgText(l.Topic), l.Partition, l.Offset, pgText(l.OriginalTopic),
			nullInt(int64(l.OriginalPartition)), nullInt(l.OriginalOffset),
			nullText(l.EventID), nullText(l.Type), pgText(l.Reason), l.Attempts,
			nullTime(l.FirstFailure), nullTime(l.EventTime), nullTime(l.DeadAt),
			nullText(l.ConsumerGroup), l.Key, nonNil(l.Value), keys, vals, l.TimeUnknown, pgText(l.Class()))
	}
	br := tx.SendBatch(ctx, b)
	var added []*Letter
	for _, l := range letters {
		var ok bool
		err := br.QueryRow().Scan(&ok)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			_ = br.Close()
			return nil, fmt.Errorf("dlq: index %s: %w", l.ID, err)
		default:
			added = append(added, l)
		}
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("dlq: index: %w", err)
	}
	return added, nil
}

// List returns the letters f selects, oldest dead first.
func (s *Store) List(ctx context.Context, f Filter) ([]*Letter, error) {
	return s.list(ctx, s.db, f, byDeadTime, "")
}

// Orders of list: by dead time for people; by position for Replay, so the
// letters of one key (one DLQ partition) are republished in their DLQ order.
const (
	byDeadTime = " ORDER BY morta_en, topic, particio, offset_dlq"
	byPosition = " ORDER BY topic, particio, offset_dlq"
)

// idColumns is columns without the bytes of the letter (clau, valor,
// headers): what Purge needs of each letter, whatever the size of the DLQ.
const idColumns = `id, topic, particio, offset_dlq, topic_original, particio_original, offset_original,
	id_esdeveniment, tipus, motiu, intents, primera_fallada, data_esdeveniment, morta_en,
	grup_consumidor, NULL::bytea, ''::bytea, '{}'::bytea[], '{}'::bytea[], estat, reproduccions,
	reproduida_en, purgada_en, temps_desconegut`

func (s *Store) list(ctx context.Context, q querier, f Filter, order, suffix string) ([]*Letter, error) {
	return s.listColumns(ctx, q, columns, f, order, suffix)
}

func (s *Store) listColumns(ctx context.Context, q querier, cols string, f Filter, order, suffix string) ([]*Letter, error) {
	var args []any
	sql := "SELECT " + cols + " FROM " + s.table + " " + f.where(&args) + order
	if f.Limit > 0 {
		sql += " LIMIT " + strconv.Itoa(f.Limit)
	}
	rows, err := q.Query(ctx, sql+suffix, args...)
	if err != nil {
		return nil, fmt.Errorf("dlq: list: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanLetter)
	if err != nil {
		return nil, fmt.Errorf("dlq: list: %w", err)
	}
	return out, nil
}

// selectIDs returns the IDs of the letters f selects, in DLQ order (topic,
// partition, offset), at most f.Limit of them (0 = all).
func (s *Store) selectIDs(ctx context.Context, f Filter) ([]string, error) {
	var args []any
	sql := "SELECT id FROM " + s.table + " " + f.where(&args) + byPosition
	if f.Limit > 0 {
		sql += " LIMIT " + strconv.Itoa(f.Limit)
	}
	rows, err := s.db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("dlq: ids: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("dlq: ids: %w", err)
	}
	return out, nil
}

// count returns how many letters f selects (f.Limit is ignored).
func (s *Store) count(ctx context.Context, f Filter) (int, error) {
	var args []any
	var n int
	if err := s.db.QueryRow(ctx, "SELECT count(*) FROM "+s.table+" "+f.where(&args), args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("dlq: count: %w", err)
	}
	return n, nil
}

// listFolded is List with one letter per event and consumer: of the letters
// f selects that share an id_esdeveniment and a grup_consumidor (after a
// SIGKILL both retry copies of one message can reach the restarted consumer
// and give two letters), it returns the newest, with Copies set to how many
// there are. A letter without id_esdeveniment is its own event. f.Limit caps
// the rows returned.
func (s *Store) listFolded(ctx context.Context, f Filter) ([]*Letter, error) {
	var args []any
	part := "PARTITION BY coalesce(id_esdeveniment, id), coalesce(grup_consumidor, '')"
	sql := "SELECT " + columns + ", copies FROM (SELECT *, count(*) OVER (" + part + ") AS copies, " +
		"row_number() OVER (" + part + " ORDER BY morta_en DESC NULLS LAST, id DESC) AS rn FROM " + s.table + " " +
		f.where(&args) + ") folded WHERE rn = 1" + byDeadTime
	if f.Limit > 0 {
		sql += " LIMIT " + strconv.Itoa(f.Limit)
	}
	rows, err := s.db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("dlq: list folded: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*Letter, error) {
		var n int64
		l, err := scanLetterAnd(r, &n)
		if l != nil {
			l.Copies = int(n)
		}
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("dlq: list folded: %w", err)
	}
	return out, nil
}

// Get returns one letter, or ErrNotFound.
func (s *Store) Get(ctx context.Context, id string) (*Letter, error) {
	out, err := s.list(ctx, s.db, Filter{IDs: []string{id}}, byDeadTime, "")
	if err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	return out[0], nil
}

// Group is the count of letters of one DLQ topic with one reason class.
type Group struct {
	Topic string `json:"topic"`
	// Consumer is the consumer group that dead-lettered the group's letters
	// (grup_consumidor); NoConsumer when they name none.
	Consumer string    `json:"grup_consumidor"`
	Class    string    `json:"classe_motiu"`
	Count    int       `json:"cartes"`
	Oldest   time.Time `json:"primera"`
	Newest   time.Time `json:"darrera"`
}

// NoConsumer is Group.Consumer for letters that name no consumer group
// (grup_consumidor absent or empty); Filter.NoGroup selects them.
const NoConsumer = "-"

// Summary counts the letters f selects by DLQ topic, consumer group and
// reason class (one event that failed in two consumers is in two groups),
// largest groups first.
func (s *Store) Summary(ctx context.Context, f Filter) ([]Group, error) {
	var args []any
	rows, err := s.db.Query(ctx, "SELECT topic, coalesce(nullif(grup_consumidor, ''), '"+NoConsumer+"') AS consumidor, classe_motiu, count(*), min(morta_en), max(morta_en) FROM "+
		s.table+" "+f.where(&args)+" GROUP BY topic, consumidor, classe_motiu ORDER BY count(*) DESC, topic, consumidor, classe_motiu", args...)
	if err != nil {
		return nil, fmt.Errorf("dlq: summary: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Group, error) {
		var g Group
		var oldest, newest *time.Time // NULL when every letter of the group has an unknown time
		err := r.Scan(&g.Topic, &g.Consumer, &g.Class, &g.Count, &oldest, &newest)
		g.Oldest, g.Newest = derefTime(oldest), derefTime(newest)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("dlq: summary: %w", err)
	}
	return out, nil
}

// lockTx selects the letters of f in tx, in DLQ order, with FOR UPDATE SKIP
// LOCKED, so two operators replaying or purging at once never act on the
// same letter.
func (s *Store) lockTx(ctx context.Context, tx pgx.Tx, f Filter) ([]*Letter, error) {
	return s.list(ctx, tx, f, byPosition, " FOR UPDATE SKIP LOCKED")
}

// lockIDsTx is lockTx without the letters' bytes (see idColumns).
func (s *Store) lockIDsTx(ctx context.Context, tx pgx.Tx, f Filter) ([]*Letter, error) {
	return s.listColumns(ctx, tx, idColumns, f, byPosition, " FOR UPDATE SKIP LOCKED")
}

// markReplayedTx records a replay of ids.
func (s *Store) markReplayedTx(ctx context.Context, tx pgx.Tx, ids []string) error {
	_, err := tx.Exec(ctx, "UPDATE "+s.table+" SET estat = 'reproduida', reproduccions = reproduccions + 1, "+
		"reproduida_en = clock_timestamp(), purgada_en = NULL WHERE id = ANY($1)", ids)
	if err != nil {
		return fmt.Errorf("dlq: mark replayed: %w", err)
	}
	return nil
}

// markPurgedTx marks ids purged.
func (s *Store) markPurgedTx(ctx context.Context, tx pgx.Tx, ids []string) error {
	_, err := tx.Exec(ctx, "UPDATE "+s.table+" SET estat = 'purgada', purgada_en = clock_timestamp() WHERE id = ANY($1)", ids)
	if err != nil {
		return fmt.Errorf("dlq: mark purged: %w", err)
	}
	return nil
}

// TopicPartition is one partition of a DLQ topic.
type TopicPartition struct {
	Topic     string
	Partition int32
}

// Position is a point in one partition of a DLQ topic.
type Position struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"particio"`
	Offset    int64  `json:"offset"`
}

// DeletableBefore returns, for each partition of the given DLQ topics that
// the index holds letters of, the offset before which every record is indexed
// and no longer pending: the lowest pending offset, or one past the highest
// indexed offset when none is pending. Deleting records before it loses no
// pending letter and no record the index has not seen.
// IndexedNext returns, for each partition of topics with a letter in this
// index, the offset after the highest one indexed. Readers start at the lower
// of it and their group's committed offset: the group may have been moved on
// by a reader writing another index (another --schema), whose letters this
// index never got.
func (s *Store) IndexedNext(ctx context.Context, topics []string) (map[TopicPartition]int64, error) {
	rows, err := s.db.Query(ctx, `SELECT topic, particio, max(offset_dlq) + 1 FROM `+s.table+`
		WHERE topic = ANY($1) GROUP BY topic, particio`, topics)
	if err != nil {
		return nil, fmt.Errorf("dlq: indexed offsets: %w", err)
	}
	out := map[TopicPartition]int64{}
	var k TopicPartition
	var next int64
	_, err = pgx.ForEachRow(rows, []any{&k.Topic, &k.Partition, &next}, func() error {
		out[k] = next
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dlq: indexed offsets: %w", err)
	}
	return out, nil
}

func (s *Store) DeletableBefore(ctx context.Context, topics []string) ([]Position, error) {
	rows, err := s.db.Query(ctx, `SELECT topic, particio,
		COALESCE(min(offset_dlq) FILTER (WHERE estat = 'pendent'), max(offset_dlq) + 1)
		FROM `+s.table+` WHERE topic = ANY($1) GROUP BY topic, particio ORDER BY topic, particio`, topics)
	if err != nil {
		return nil, fmt.Errorf("dlq: deletable: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Position, error) {
		var p Position
		return p, r.Scan(&p.Topic, &p.Partition, &p.Offset)
	})
	if err != nil {
		return nil, fmt.Errorf("dlq: deletable: %w", err)
	}
	return out, nil
}

func scanLetter(r pgx.CollectableRow) (*Letter, error) { return scanLetterAnd(r) }

// scanLetterAnd scans a letter's columns, then extra.
func scanLetterAnd(r pgx.CollectableRow, extra ...any) (*Letter, error) {
	l := &Letter{}
	var (
		op, oo              *int64
		eid, typ, group     *string
		ff, et, rep, pur    *time.Time
		dead                *time.Time
		hkeys, hvals        [][]byte
		state               string
		partition, attempts int32
		replays             int32
	)
	err := r.Scan(append([]any{&l.ID, &l.Topic, &partition, &l.Offset, &l.OriginalTopic, &op, &oo,
		&eid, &typ, &l.Reason, &attempts, &ff, &et, &dead, &group, &l.Key, &l.Value,
		&hkeys, &hvals, &state, &replays, &rep, &pur, &l.TimeUnknown}, extra...)...)
	if err != nil {
		return nil, err
	}
	l.Partition, l.Attempts, l.Replays, l.State = partition, int(attempts), int(replays), State(state)
	l.OriginalPartition, l.OriginalOffset = -1, -1
	if op != nil {
		l.OriginalPartition = int32(*op)
	}
	if oo != nil {
		l.OriginalOffset = *oo
	}
	l.EventID, l.Type, l.ConsumerGroup = deref(eid), deref(typ), deref(group)
	l.FirstFailure, l.EventTime, l.ReplayedAt, l.PurgedAt = derefTime(ff), derefTime(et), derefTime(rep), derefTime(pur)
	l.DeadAt = derefTime(dead)
	if len(hkeys) != len(hvals) {
		return nil, fmt.Errorf("dlq: letter %s: %d header keys, %d values", l.ID, len(hkeys), len(hvals))
	}
	for i := range hkeys {
		l.Headers = append(l.Headers, transport.Header{Key: string(hkeys[i]), Value: string(hvals[i])})
	}
	return l, nil
}

// headerBytes returns the header keys and values as stored (capcaleres_*).
func headerBytes(h []transport.Header) (keys, vals [][]byte) {
	keys, vals = make([][]byte, len(h)), make([][]byte, len(h))
	for i, x := range h {
		keys[i], vals[i] = []byte(x.Key), []byte(x.Value)
	}
	return keys, vals
}

// nonNil returns v, or an empty slice for nil (valor is NOT NULL).
func nonNil(v []byte) []byte {
	if v == nil {
		return []byte{}
	}
	return v
}

func nullInt(v int64) any {
	if v < 0 {
		return nil
	}
	return v
}

func nullText(s string) any {
	if s == "" {
		return nil
	}
	return pgText(s)
}

// pgText makes header text storable in a TEXT column: PostgreSQL refuses NUL
// and invalid UTF-8, and a letter the index refuses would block the indexer.
// The exact bytes stay in valor and capcaleres_*.
func pgText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}

func nullTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func derefTime(t *time.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return t.UTC()
}
