package pagaments

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

// RefundKey is the gateway Idempotency-Key of an order's refund.
func RefundKey(orderID string) string { return "reemborsament-" + orderID }

// orderLockClass is the first key of the transaction-scoped advisory lock
// that serialises the charge and the refund of one order (the second is
// hashtext(order id)); the two-key space does not overlap the one-key locks
// of the outbox trigger.
const orderLockClass = 0x706167 // "pag"

// lockOrder takes the order's lock until tx ends. The charge of an order and
// its cancellation can run at once in two workers (the creation's retry copy
// beside the cancellation that overtook it); whichever takes the lock second
// sees what the first committed.
func lockOrder(ctx context.Context, tx pgx.Tx, orderID string) error {
	_, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1, hashtext($2))`, orderLockClass, orderID)
	return err
}

// HandleOrder is the consumer.Handler of the pagaments.cobrament consumer:
// comanda.creada charges (HandleOrderCreated), comanda.cancellada refunds
// (HandleOrderCancelled). One consumer for both, so that per-key order can
// keep a cancellation behind its creation.
func (s *Service) HandleOrder(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if m.Envelope.Type == TypeOrderCancelled {
		return s.HandleOrderCancelled(ctx, tx, m)
	}
	return s.HandleOrderCreated(ctx, tx, m)
}

// HandleOrderCancelled is the consumer.Handler of comanda.cancellada: under
// the order's lock it records the cancellation (a tombstone: a charge that
// comes later charges nothing) and, unless a refund is recorded, asks the
// gateway to refund whatever the charge key cobrament-<order id> charged,
// with Idempotency-Key reemborsament-<order id> (a charge attempt that timed
// out may have charged without a payment here; with no charge the gateway
// voids the key, so a charge request still in flight charges nothing), and
// records the refund, in the consumer's transaction. A crash between the gateway call and the commit
// refunds again with the same key, and the gateway returns the refund it
// made: one refund. A second cancellation changes nothing. Gateway
// unavailable → transient; refused → permanent "reemborsament_refusat".
func (s *Service) HandleOrderCancelled(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var c struct {
		OrderID string `json:"comanda_id"`
		Reason  string `json:"motiu"`
	}
	if err := strictjson.Unmarshal(m.Envelope.Data, &c); err != nil {
		return outcome.Permanentf("esquema: comanda.cancellada: %v", err)
	}
	if c.OrderID == "" || c.Reason == "" {
		return outcome.Permanentf("esquema: comanda.cancellada without comanda_id or motiu")
	}
	if err := requestreply.CheckID("esquema: comanda.cancellada: comanda_id", c.OrderID, 0); err != nil {
		return err
	}
	if err := requestreply.CheckID("esquema: comanda.cancellada: motiu", c.Reason, 0); err != nil {
		return err
	}
	if err := lockOrder(ctx, tx, c.OrderID); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO cancellacions (comanda_id, motiu) VALUES ($1, $2) ON CONFLICT DO NOTHING`, c.OrderID, c.Reason); err != nil {
		return err
	}
	var refunded bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM reemborsaments WHERE comanda_id = $1)`, c.OrderID).Scan(&refunded); err != nil {
		return err
	}
	if refunded {
		return nil
	}
	if s.cfg.Gateway == nil {
		return errors.New("pagaments: Config.Gateway is required to refund")
	}
	// Asked whether or not a payment is recorded: a charge attempt that
	// timed out may have charged at the gateway and rolled back here. The
	// gateway refunds what its charge key charged, or voids the key.
	rf, err := s.cfg.Gateway.Refund(ctx, RefundKey(c.OrderID), c.OrderID, ChargeKey(c.OrderID))
	switch {
	case errors.Is(err, passarella.ErrRefused):
		return outcome.Permanentf("reemborsament_refusat: %s: %v", c.OrderID, err)
	case err != nil:
		return outcome.Transient(fmt.Errorf("passarella: refund %s: %w", c.OrderID, err))
	}
	if h := faults.PaymentsFrom(ctx).AfterRefund; h != nil {
		if err := h(c.OrderID); err != nil {
			return err
		}
	}
	if rf.Void {
		return nil // nothing was charged, and now nothing can be
	}
	_, err = tx.Exec(ctx, `INSERT INTO reemborsaments (comanda_id, import_centims, ref_passarella, ref_reemborsament) VALUES ($1, $2, $3, $4)`,
		c.OrderID, rf.TotalCents, rf.ChargeRef, rf.Ref)
	return err
}

// Refunds returns the recorded refunds: order id → amount.
func (s *Service) Refunds(ctx context.Context) (map[string]int64, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT comanda_id, import_centims FROM reemborsaments`)
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	var (
		id string
		n  int64
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error { out[id] = n; return nil })
	return out, err
}
