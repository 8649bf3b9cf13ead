package comandes

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outcome"
)

// Names of repartiment's events that comandes consumes (consumidor
// ConsumerDelivery, topic repartiment.esdeveniments).
const (
	// TypeCoverage is repartiment's snapshot of the cities it delivers to.
	TypeCoverage = "repartiment.cobertura"
	// TypeDeliveryRejected is repartiment's refusal of a paid order: comandes cancels it.
	TypeDeliveryRejected = "repartiment.rebutjat"
	// ConsumerDelivery is the consumidor of both.
	ConsumerDelivery = "comandes.repartiment"
	// ReasonNotCovered is the codi of POST /comandes for an uncovered city
	// and the motiu of the cancellation of an order repartiment rejected
	// for it.
	ReasonNotCovered = "ciutat_no_coberta"
)

// coverage is the dades of repartiment.cobertura.
type coverage struct {
	Cities   []string `json:"ciutats"`
	Revision int64    `json:"revisio"`
}

// deliveryRejected is the dades of repartiment.rebutjat.
type deliveryRejected struct {
	OrderID string `json:"comanda_id"`
	Reason  string `json:"motiu"`
	City    string `json:"ciutat"`
}

// HandleDelivery is the consumer.Handler of the ConsumerDelivery consumer:
// repartiment.cobertura updates the copy of the coverage
// (HandleCoverage), repartiment.rebutjat cancels the order
// (HandleDeliveryRejected).
func (s *Service) HandleDelivery(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if m.Envelope.Type == TypeCoverage {
		return s.HandleCoverage(ctx, tx, m)
	}
	return s.HandleDeliveryRejected(ctx, tx, m)
}

// HandleCoverage keeps, in tx, the snapshot of repartiment.cobertura if its
// revisio is at least the one kept (an older snapshot, redelivered late,
// changes nothing): the cities POST /comandes accepts. Idempotent by nature.
// A payload without revisio is permanent "esquema".
func (s *Service) HandleCoverage(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var c coverage
	if err := strictjson.Unmarshal(m.Envelope.Data, &c); err != nil || c.Revision <= 0 {
		return outcome.Permanentf("esquema: repartiment.cobertura without revisio: %v", err)
	}
	tag, err := tx.Exec(ctx, `INSERT INTO cobertura (revisio) VALUES ($1)
		ON CONFLICT (id) DO UPDATE SET revisio = excluded.revisio, rebut_en = now() WHERE cobertura.revisio <= excluded.revisio`, c.Revision)
	if err != nil || tag.RowsAffected() == 0 {
		return err
	}
	cities := make([]string, 0, len(c.Cities))
	for _, city := range c.Cities {
		if n := normalizeCity(city); n != "" {
			cities = append(cities, n)
		}
	}
	if _, err := tx.Exec(ctx, `DELETE FROM ciutats_cobertes`); err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `INSERT INTO ciutats_cobertes SELECT DISTINCT unnest($1::text[])`, cities)
	return err
}

// HandleDeliveryRejected is the compensation of an order repartiment
// cannot deliver (its coverage changed after comandes accepted the order,
// or comandes had no copy of it yet): in tx it cancels the order with the
// rejection's motiu (ciutat_no_coberta) through CancelTx, so comanda.cancellada
// goes out, pagaments refunds the charge and inventari puts the stock back,
// as for a stock refusal. An order already cancelled changes nothing; an
// unknown order or a payload without comanda_id is permanent.
func (s *Service) HandleDeliveryRejected(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var p deliveryRejected
	if err := strictjson.Unmarshal(m.Envelope.Data, &p); err != nil {
		return outcome.Permanentf("esquema: repartiment.rebutjat: %v", err)
	}
	if p.OrderID == "" || p.Reason == "" {
		return outcome.Permanentf("esquema: repartiment.rebutjat without comanda_id or motiu")
	}
	detail := ""
	if p.City != "" {
		detail = "ciutat " + p.City
	}
	_, err := s.CancelTx(ctx, tx, p.OrderID, p.Reason, detail)
	if errors.Is(err, errNoOrder) {
		return outcome.Permanentf("comanda_desconeguda: %s", clip(p.OrderID))
	}
	return err
}

// Coverage returns comandes's copy of the covered cities (sorted) and the
// revisio of its snapshot; revisio 0 when no snapshot came yet (every city
// is accepted then).
func (s *Service) Coverage(ctx context.Context) ([]string, int64, error) {
	var (
		cities   []string
		revision int64
	)
	err := s.cfg.Pool.QueryRow(ctx, `SELECT coalesce((SELECT revisio FROM cobertura), 0),
		coalesce((SELECT array_agg(ciutat ORDER BY ciutat) FROM ciutats_cobertes), '{}')`).Scan(&revision, &cities)
	return cities, revision, err
}

// errNotCovered: the order's delivery city is not in the copy of the coverage.
type errNotCovered struct {
	city    string
	covered []string
}

func (e *errNotCovered) Error() string {
	return fmt.Sprintf("delivery city %q is not covered by repartiment (covered: %s)", clip(e.city), strings.Join(e.covered, ", "))
}

// checkCoverage returns an *errNotCovered when o's delivery city is not in
// the copy of the coverage. An order without an address (versio 1) and any
// order before the first snapshot pass; a database error is returned as is.
func (s *Service) checkCoverage(ctx context.Context, o *Order) error {
	if o.Address == nil {
		return nil
	}
	var known, covered bool
	if err := s.cfg.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM cobertura), EXISTS (SELECT 1 FROM ciutats_cobertes WHERE ciutat = $1)`,
		normalizeCity(o.Address.City)).Scan(&known, &covered); err != nil {
		return err
	}
	if !known || covered {
		return nil
	}
	cities, _, err := s.Coverage(ctx)
	if err != nil {
		return err
	}
	return &errNotCovered{city: o.Address.City, covered: cities}
}

// writeNotCovered answers 422 with codi ciutat_no_coberta.
func writeNotCovered(w http.ResponseWriter, e *errNotCovered) {
	svc.WriteError(w, http.StatusUnprocessableEntity, svc.CodeCityNotCovered, "adreca_lliurament.ciutat", e.Error())
}

// normalizeCity compares cities as repartiment does (repartiment.NormalizeCity):
// trimmed, lower case.
func normalizeCity(city string) string { return strings.ToLower(strings.TrimSpace(city)) }
