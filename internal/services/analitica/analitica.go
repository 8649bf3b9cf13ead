// Package analitica counts events per tipus and orders per mercat. It is the
// at-most-once consumer of CONTRACT.md guarantee 1: its offsets are committed
// before processing (consumer.AtMostOnce, no inbox), because a lost count is
// acceptable for analytics and the next event replaces nothing critical. A
// count is lost, never added: a copy of an event it counted recently (the
// same id_esdeveniment, RecentEventsDefault) in a transaction that did not
// roll back is dropped. Counters are served at GET /analitica.
package analitica

import (
	"context"
	"embed"
	"errors"
	"net/http"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/migrate"
)

// Names.
const (
	Name = "analitica" // database km0_analitica
	// ConsumerCount is the consumidor (and consumer group) of the counter.
	ConsumerCount = "analitica.comptadors"
	// TypeOrderCreated is the event whose mercat is counted.
	TypeOrderCreated = "comanda.creada"
	// TypeOrderCancelled is the event whose motiu is counted.
	TypeOrderCancelled = "comanda.cancellada"
)

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations creates the counter tables. No inbox: at-most-once.
var Migrations = migrate.Set{Name: "analitica", FS: sqlFS, Dir: "sql"}

// ReasonOther is the motiu under which a cancellation whose motiu is not in
// KnownCancelReasons is counted.
const ReasonOther = "altres"

// KnownCancelReasons are the motius of comanda.cancellada counted under their
// own name: comandes' default (client), inventari's refusals and
// repartiment's (ciutat_no_coberta, the compensation of a rejected delivery). Any other
// motiu (free text of POST /comandes/{id}/cancellacio) counts as ReasonOther,
// so the counters stay a handful of rows whatever callers send.
var KnownCancelReasons = []string{"client", "estoc_insuficient", "producte_desconegut", "ciutat_no_coberta"}

// Service is the analitica service. It is safe for concurrent use.
type Service struct {
	pool   *pgxpool.Pool
	recent *recentIDs // id_esdeveniment counted lately
}

// New returns a Service that remembers the RecentEventsDefault latest
// events it counted; it fails without a pool.
func New(pool *pgxpool.Pool) (*Service, error) {
	if pool == nil {
		return nil, errors.New("analitica: pool is required")
	}
	return &Service{pool: pool, recent: newRecentIDs(RecentEventsDefault)}, nil
}

// cancelReason returns the counter row of motiu m.
func cancelReason(m string) string {
	if slices.Contains(KnownCancelReasons, m) {
		return m
	}
	return ReasonOther
}

// HandleEvent is the consumer.Handler of every event of every domain topic:
// it adds one to the event's tipus and, for comanda.creada, to its mercat,
// for comanda.cancellada, to its motiu (cancelReason: a known one or
// ReasonOther). Undecodable dades are counted under the tipus only; it never
// fails on data.
//
// A copy of an event among the RecentEventsDefault it counted last (same
// id_esdeveniment) changes nothing, unless the transaction that counted it
// rolled back (pg_xact_status 'aborted': the consumer reruns a batch that
// failed), and then it counts. The transaction is remembered rather than the
// count, because a handler's success does not mean its batch committed. A
// copy whose first count is under way, in this transaction or another, is
// dropped: if that one rolls back, the count is lost (at most once).
func (s *Service) HandleEvent(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	id := m.Envelope.ID
	if id == "" { // the envelope's decoder refuses it; nothing to tell copies by
		_, err := s.count(ctx, tx, m)
		return err
	}
	prev, seen := s.recent.reserve(id)
	if seen {
		if prev == 0 {
			return nil // being counted by another handler of this process
		}
		var status *string
		if err := tx.QueryRow(ctx, `SELECT pg_xact_status($1::text::xid8)`, strconv.FormatUint(prev, 10)).Scan(&status); err != nil {
			return err
		}
		// committed, in progress (this batch, or another), or too old to
		// tell (NULL): counted already.
		if status == nil || *status != "aborted" || !s.recent.retake(id, prev) {
			return nil
		}
	}
	xid, err := s.count(ctx, tx, m)
	if err != nil {
		s.recent.remove(id)
		return err
	}
	s.recent.counted(id, xid)
	return nil
}

// count adds the event to the counters in tx and returns tx's id (xid8).
func (s *Service) count(ctx context.Context, tx pgx.Tx, m *consumer.Message) (uint64, error) {
	var xid uint64
	if err := tx.QueryRow(ctx, `INSERT INTO comptadors_tipus (tipus, n) VALUES ($1, 1)
		ON CONFLICT (tipus) DO UPDATE SET n = comptadors_tipus.n + 1 RETURNING pg_current_xact_id()::text::bigint`, m.Envelope.Type).Scan(&xid); err != nil {
		return 0, err
	}
	return xid, s.countDades(ctx, tx, m)
}

// countDades adds a comanda.creada to its mercat, a comanda.cancellada to its motiu.
func (s *Service) countDades(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if m.Envelope.Type == TypeOrderCancelled {
		var c struct {
			Reason string `json:"motiu"`
		}
		if strictjson.Unmarshal(m.Envelope.Data, &c) != nil || c.Reason == "" {
			return nil
		}
		_, err := tx.Exec(ctx, `INSERT INTO comptadors_cancellacio (motiu, n) VALUES ($1, 1)
			ON CONFLICT (motiu) DO UPDATE SET n = comptadors_cancellacio.n + 1`, cancelReason(c.Reason))
		return err
	}
	if m.Envelope.Type != TypeOrderCreated {
		return nil
	}
	var o struct {
		Market string `json:"mercat"`
	}
	if strictjson.Unmarshal(m.Envelope.Data, &o) != nil || o.Market == "" {
		return nil
	}
	_, err := tx.Exec(ctx, `INSERT INTO comptadors_mercat (mercat, n) VALUES ($1, 1)
		ON CONFLICT (mercat) DO UPDATE SET n = comptadors_mercat.n + 1`, o.Market)
	return err
}

// Counters are the answer of GET /analitica.
type Counters struct {
	PerType   map[string]int64 `json:"per_tipus"`
	PerMarket map[string]int64 `json:"per_mercat"`
	// PerCancelReason counts comanda.cancellada per motiu: the
	// KnownCancelReasons and ReasonOther.
	PerCancelReason map[string]int64 `json:"cancellacions_per_motiu"`
}

// Counters reads the counters.
func (s *Service) Counters(ctx context.Context) (*Counters, error) {
	c := &Counters{PerType: map[string]int64{}, PerMarket: map[string]int64{}, PerCancelReason: map[string]int64{}}
	for _, q := range []struct {
		sql string
		out map[string]int64
	}{{`SELECT tipus, n FROM comptadors_tipus`, c.PerType}, {`SELECT mercat, n FROM comptadors_mercat`, c.PerMarket},
		{`SELECT motiu, n FROM comptadors_cancellacio`, c.PerCancelReason}} {
		rows, err := s.pool.Query(ctx, q.sql)
		if err != nil {
			return nil, err
		}
		var (
			k string
			n int64
		)
		if _, err := pgx.ForEachRow(rows, []any{&k, &n}, func() error { q.out[k] = n; return nil }); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Handler returns GET /analitica.
func (s *Service) Handler() http.Handler {
	return svc.GetJSON("/analitica", "could not read the counters", func(ctx context.Context) (any, error) { return s.Counters(ctx) })
}
