// Package pagaments is the payments service of Quilòmetre Zero: the card
// authorisation server of pagaments.autoritzacions (request/reply) and the
// idempotent charging consumer (consumidor pagaments.cobrament),
// which charges through the payment gateway with Idempotency-Key
// cobrament-<order id>, records the payment and writes pagament.confirmat
// through the outbox in one transaction.
package pagaments

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"log/slog"
	"math"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

// Names of CONTRACT.md.
const (
	Name  = "pagaments"               // origen of its events; database km0_pagaments
	Topic = "pagaments.esdeveniments" // where it publishes
	// TypeConfirmed is published when an order has been charged.
	TypeConfirmed = "pagament.confirmat"
	// TypeOrderCreated is the event it consumes.
	TypeOrderCreated = "comanda.creada"
	// TypeOrderCancelled is consumed by the same consumer: it refunds.
	TypeOrderCancelled = "comanda.cancellada"
	// ConsumerCharge is the consumidor of the charging handler.
	ConsumerCharge = "pagaments.cobrament"
	// AuthQueue is the request/reply queue of card authorisations.
	AuthQueue = "pagaments.autoritzacions"
	// Aggregate is the outbox agregat; agregat_id is the order id.
	Aggregate = "pagament"
)

// AuthLimitCentsDefault: authorisations above this amount are refused.
const AuthLimitCentsDefault = 200_000

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations creates pagaments, autoritzacions, cancellacions and reemborsaments. Apply it with
// migrate.Outbox and migrate.Inbox.
var Migrations = migrate.Set{Name: "pagaments", FS: sqlFS, Dir: "sql"}

// Final reports whether err refuses an order's charge for good (the card was
// refused): a business outcome, not a fault an operator fixes and replays. In
// per-key order (consumer.Config.FinalFailure) such an order is dead-lettered
// but does not block its key, so its cancellation is applied behind it.
func Final(err error) bool {
	return errors.Is(err, passarella.ErrRefused) || errors.Is(err, ErrNotAuthorised)
}

// ErrNotAuthorised is wrapped (outcome.Permanent, motiu
// "sense_autoritzacio: ...") by HandleOrderCreated's error for an order that
// has no approved authorisation for its total, with Config.RequireApproval.
var ErrNotAuthorised = errors.New("no approved authorisation stored for the order's total")

// Gateway charges cards; *passarella.Client is the implementation. It must
// deduplicate by key: that is what makes a crash after the call and before
// the commit safe.
type Gateway interface {
	Charge(ctx context.Context, key, orderID string, totalCents int64) (passarella.Charge, error)
	// Refund refunds the whole charge made under chargeKey (or voids the
	// key when nothing was charged), deduplicated by key too.
	Refund(ctx context.Context, key, orderID, chargeKey string) (passarella.Refund, error)
}

// Config configures a Service.
type Config struct {
	Pool    *pgxpool.Pool  // km0_pagaments, migrated; required
	Gateway Gateway        // required for HandleOrderCreated
	Outbox  *outbox.Outbox // default outbox.New(outbox.Config{})
	// AuthLimitCents: Authorize refuses larger amounts. Default AuthLimitCentsDefault.
	AuthLimitCents int64
	// RequireApproval makes HandleOrderCreated charge only an order whose
	// authorisation Authorize stored, approved, for at least the order's
	// total (set it when comandes asks for authorisations: a comanda.creada
	// without one did not come through them). Otherwise the order is refused
	// with a permanent ErrNotAuthorised and the gateway is not called.
	// Default false: every well-formed order is charged.
	RequireApproval bool
	Logger          *slog.Logger // default slog.Default()
}

// Service is the pagaments service. It is safe for concurrent use.
type Service struct {
	cfg  Config
	auth *authBatcher
}

// New returns a Service; it fails without a pool.
func New(cfg Config) (*Service, error) {
	if cfg.Pool == nil {
		return nil, errors.New("pagaments: Config.Pool is required")
	}
	if cfg.Outbox == nil {
		cfg.Outbox = outbox.New(outbox.Config{})
	}
	if cfg.AuthLimitCents <= 0 {
		cfg.AuthLimitCents = AuthLimitCentsDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Service{cfg: cfg, auth: newAuthBatcher(cfg.Pool)}, nil
}

// Confirmed is the dades of pagament.confirmat.
type Confirmed struct {
	OrderID    string `json:"comanda_id"`
	TotalCents int64  `json:"import_centims"`
	GatewayRef string `json:"ref_passarella"`
}

type orderCreated struct {
	ID    string `json:"id"`
	Lines []struct {
		Quantity   int64 `json:"quantitat"`
		PriceCents int64 `json:"preu_centims"`
	} `json:"linies"`
}

// ChargeKey is the gateway Idempotency-Key of an order's charge.
func ChargeKey(orderID string) string { return "cobrament-" + orderID }

// HandleOrderCreated is the consumer.Handler of comanda.creada (consumidor
// ConsumerCharge), an idempotent consumer with an idempotent gateway call. Inside the
// consumer's transaction, which holds the idempotency key, it charges through
// the gateway with Idempotency-Key cobrament-<order id>, inserts the payment
// and writes pagament.confirmat. If the process dies between the charge and
// the commit, nothing of the attempt persists; the redelivery charges again
// with the same key and the gateway returns the charge it already made: one
// charge. An order already recorded (another event id for the same order) is
// not recorded or confirmed twice. Gateway unavailable or slow → transient;
// refused → permanent "targeta_refusada"; a malformed event, or an order id
// requestreply.CheckID refuses → permanent "esquema"; with
// Config.RequireApproval, no approved authorisation for the total →
// permanent "sense_autoritzacio" (ErrNotAuthorised), nothing charged.
func (s *Service) HandleOrderCreated(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if s.cfg.Gateway == nil {
		return errors.New("pagaments: Config.Gateway is required to charge")
	}
	var o orderCreated
	if err := strictjson.Unmarshal(m.Envelope.Data, &o); err != nil {
		return outcome.Permanentf("esquema: comanda.creada: %v", err)
	}
	if o.ID == "" || len(o.Lines) == 0 {
		return outcome.Permanentf("esquema: comanda.creada without id or linies")
	}
	if err := requestreply.CheckID("esquema: comanda.creada: id", o.ID, 0); err != nil {
		return err // it could be neither charged nor stored: no retry helps
	}
	var total int64
	for i, l := range o.Lines {
		// Checked: a wrapped amount would charge a wrong (even zero) total.
		if l.Quantity < 1 || l.PriceCents < 0 ||
			(l.PriceCents > 0 && l.Quantity > math.MaxInt64/l.PriceCents) ||
			total > math.MaxInt64-l.Quantity*l.PriceCents {
			return outcome.Permanentf("esquema: comanda.creada %s: linies[%d]: quantitat %d × preu_centims %d out of range", o.ID, i, l.Quantity, l.PriceCents)
		}
		total += l.Quantity * l.PriceCents
	}
	// Under the order's lock: a cancellation recorded first (it overtook
	// the creation) leaves nothing to charge.
	if err := lockOrder(ctx, tx, o.ID); err != nil {
		return err
	}
	var cancelled bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM cancellacions WHERE comanda_id = $1)`, o.ID).Scan(&cancelled); err != nil {
		return err
	}
	if cancelled {
		return nil
	}
	if s.cfg.RequireApproval {
		if err := checkApproval(ctx, tx, o.ID, total); err != nil {
			return err
		}
	}
	ch, err := s.cfg.Gateway.Charge(ctx, ChargeKey(o.ID), o.ID, total)
	switch {
	case errors.Is(err, passarella.ErrRefused):
		return outcome.Permanent(fmt.Errorf("targeta_refusada: %s: %w", o.ID, err))
	case err != nil:
		return outcome.Transient(fmt.Errorf("passarella: %s: %w", o.ID, err))
	}
	if h := faults.PaymentsFrom(ctx).AfterCharge; h != nil {
		if err := h(o.ID); err != nil {
			return err
		}
	}
	tag, err := tx.Exec(ctx, `INSERT INTO pagaments (comanda_id, import_centims, ref_passarella) VALUES ($1, $2, $3)
		ON CONFLICT (comanda_id) DO NOTHING`, o.ID, ch.TotalCents, ch.Ref)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return nil // already recorded and confirmed
	}
	return s.cfg.Outbox.Enqueue(ctx, tx, &outbox.Event{Aggregate: Aggregate, AggregateID: o.ID, Type: TypeConfirmed,
		Payload: Confirmed{OrderID: o.ID, TotalCents: ch.TotalCents, GatewayRef: ch.Ref}})
}

// checkApproval returns a permanent ErrNotAuthorised unless orderID has an
// approved authorisation stored for at least total. Authorize commits the
// row before it answers and comandes creates the order only after the
// answer, so a genuine comanda.creada always finds it.
func checkApproval(ctx context.Context, tx pgx.Tx, orderID string, total int64) error {
	var approved bool
	var cents int64
	err := tx.QueryRow(ctx, `SELECT aprovada, import_centims FROM autoritzacions WHERE comanda_id = $1`, orderID).Scan(&approved, &cents)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return outcome.Permanent(fmt.Errorf("sense_autoritzacio: %s: none stored: %w", orderID, ErrNotAuthorised))
	case err != nil:
		return err
	case !approved:
		return outcome.Permanent(fmt.Errorf("sense_autoritzacio: %s: the authorisation was refused: %w", orderID, ErrNotAuthorised))
	case total > cents:
		return outcome.Permanent(fmt.Errorf("sense_autoritzacio: %s: total %d cents above the %d authorised: %w", orderID, total, cents, ErrNotAuthorised))
	}
	return nil
}

// Payments returns the recorded payments: order id → (amount, gateway ref).
func (s *Service) Payments(ctx context.Context) (map[string]Confirmed, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT comanda_id, import_centims, ref_passarella FROM pagaments`)
	if err != nil {
		return nil, err
	}
	out := map[string]Confirmed{}
	var c Confirmed
	_, err = pgx.ForEachRow(rows, []any{&c.OrderID, &c.TotalCents, &c.GatewayRef}, func() error { out[c.OrderID] = c; return nil })
	return out, err
}
