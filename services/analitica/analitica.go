// Package analitica counts events per tipus and orders per mercat. It is the
// at-most-once consumer of CONTRACT.md guarantee 1: its offsets are committed
// before processing (consumer.AtMostOnce, no inbox), because a lost or doubled
// count is acceptable for analytics and the next event replaces nothing
// critical. Counters are served at GET /analitica.
package analitica

import (
	"context"
	"embed"
	"errors"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/services/svc"
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

// Service is the analitica service.
type Service struct{ pool *pgxpool.Pool }

// New returns a Service; it fails without a pool.
func New(pool *pgxpool.Pool) (*Service, error) {
	if pool == nil {
		return nil, errors.New("analitica: pool is required")
	}
	return &Service{pool: pool}, nil
}

// HandleEvent is the consumer.Handler of every event of every domain topic:
// it adds one to the event's tipus and, for comanda.creada, to its mercat,
// for comanda.cancellada, to its motiu.
// Undecodable dades are counted under the tipus only; it never fails on data.
func (s *Service) HandleEvent(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if _, err := tx.Exec(ctx, `INSERT INTO comptadors_tipus (tipus, n) VALUES ($1, 1)
		ON CONFLICT (tipus) DO UPDATE SET n = comptadors_tipus.n + 1`, m.Envelope.Type); err != nil {
		return err
	}
	if m.Envelope.Type == TypeOrderCancelled {
		var c struct {
			Reason string `json:"motiu"`
		}
		if strictjson.Unmarshal(m.Envelope.Data, &c) != nil || c.Reason == "" || !storable(c.Reason) {
			return nil
		}
		_, err := tx.Exec(ctx, `INSERT INTO comptadors_cancellacio (motiu, n) VALUES ($1, 1)
			ON CONFLICT (motiu) DO UPDATE SET n = comptadors_cancellacio.n + 1`, c.Reason)
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
	// PerCancelReason counts comanda.cancellada per motiu.
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
	return svc.GetJSON("/analitica", "no s'han pogut llegir els comptadors", func(ctx context.Context) (any, error) { return s.Counters(ctx) })
}

// storable reports whether PostgreSQL stores s as text: valid UTF-8, no NUL.
func storable(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0) && len(s) <= 200
}
