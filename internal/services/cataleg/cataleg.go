// Package cataleg keeps a low-stock flag per product from estoc.actualitzat:
// SET estoc_baix = (despres < 5). Applying the same event twice leaves the
// same state, so it is idempotent by nature and needs no inbox table (an
// idempotent-by-nature consumer). Served at GET /cataleg.
package cataleg

import (
	"context"
	"embed"
	"errors"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
)

// Names.
const (
	Name = "cataleg" // database km0_cataleg
	// ConsumerLowStock is the consumidor (and consumer group) of the flag.
	ConsumerLowStock = "cataleg.estoc_baix"
	// TypeStockUpdated is the event it consumes.
	TypeStockUpdated = "estoc.actualitzat"
	// LowStockBelow: a product is low on stock when despres < LowStockBelow.
	LowStockBelow = 5
)

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations creates indicadors. No inbox.
var Migrations = migrate.Set{Name: "cataleg", FS: sqlFS, Dir: "sql"}

// Service is the cataleg service.
type Service struct{ pool *pgxpool.Pool }

// New returns a Service; it fails without a pool.
func New(pool *pgxpool.Pool) (*Service, error) {
	if pool == nil {
		return nil, errors.New("cataleg: pool is required")
	}
	return &Service{pool: pool}, nil
}

// HandleStockUpdated is the consumer.Handler of estoc.actualitzat: an upsert
// setting estoc_baix = despres < 5. A payload without producte or despres is
// permanent ("esquema").
func (s *Service) HandleStockUpdated(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var e struct {
		Product string `json:"producte"`
		After   *int32 `json:"despres"` // the column is INTEGER: a larger value is a contract failure, not a retry
	}
	if err := strictjson.Unmarshal(m.Envelope.Data, &e); err != nil || e.Product == "" || e.After == nil {
		return outcome.Permanentf("esquema: estoc.actualitzat without a valid producte or despres (%v)", err)
	}
	if *e.After < 0 || strings.ContainsRune(e.Product, 0) {
		return outcome.Permanentf("esquema: estoc.actualitzat with a negative despres or a producte with NUL")
	}
	_, err := tx.Exec(ctx, `INSERT INTO indicadors (producte, estoc_baix, unitats) VALUES ($1, $2::int < $3::int, $2::int)
		ON CONFLICT (producte) DO UPDATE SET estoc_baix = EXCLUDED.estoc_baix, unitats = EXCLUDED.unitats, actualitzat_en = now()`,
		e.Product, *e.After, LowStockBelow)
	return err
}

// Flag is one product of GET /cataleg.
type Flag struct {
	Product  string `json:"producte"`
	LowStock bool   `json:"estoc_baix"`
	Units    int    `json:"unitats"`
}

// Flags returns every product's flag, by product.
func (s *Service) Flags(ctx context.Context) ([]Flag, error) {
	rows, err := s.pool.Query(ctx, `SELECT producte, estoc_baix, unitats FROM indicadors ORDER BY producte`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Flag, error) {
		var f Flag
		return f, r.Scan(&f.Product, &f.LowStock, &f.Units)
	})
}

// Handler returns GET /cataleg.
func (s *Service) Handler() http.Handler {
	return svc.GetJSON("/cataleg", "could not read the catalogue", func(ctx context.Context) (any, error) { return s.Flags(ctx) })
}
