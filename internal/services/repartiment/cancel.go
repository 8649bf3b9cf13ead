package repartiment

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

// HandleOrder is the consumer.Handler of the repartiment.assignacio
// consumer: comanda.pagada assigns (HandleOrderPaid), comanda.cancellada
// releases (HandleOrderCancelled). One consumer for both, so that per-key
// order can keep a cancellation behind its payment.
func (s *Service) HandleOrder(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if m.Envelope.Type == TypeOrderCancelled {
		return s.HandleOrderCancelled(ctx, tx, m)
	}
	return s.HandleOrderPaid(ctx, tx, m)
}

// HandleOrderCancelled is the consumer.Handler of comanda.cancellada. In the
// consumer's transaction it locks the order's delivery row and
//
//	assignat  → estat cancellat, alliberat, and the courier is free again
//	            (unless another delivery was assigned to it since)
//	pendent   → estat cancellat: the assigner skips it
//	none      → a tombstone (estat cancellat): a comanda.pagada that comes
//	            later (its retry overtaken) assigns nothing
//	rebutjat, cancellat → nothing
//
// A malformed payload is permanent "esquema".
func (s *Service) HandleOrderCancelled(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var c struct {
		OrderID string `json:"comanda_id"`
	}
	if err := strictjson.Unmarshal(m.Envelope.Data, &c); err != nil || c.OrderID == "" {
		return outcome.Permanentf("%s: comanda.cancellada unreadable or without comanda_id: %v", ReasonSchema, err)
	}
	if err := requestreply.CheckID(ReasonSchema+": comanda.cancellada: comanda_id", c.OrderID, 0); err != nil {
		return err
	}
	for range 2 {
		var (
			state      string
			courier    *string
			assignedAt *time.Time
		)
		err := tx.QueryRow(ctx, `SELECT estat, repartidor_id, assignat_en FROM lliuraments WHERE comanda_id = $1 FOR UPDATE`, c.OrderID).
			Scan(&state, &courier, &assignedAt)
		if errors.Is(err, pgx.ErrNoRows) {
			tag, err := tx.Exec(ctx, `INSERT INTO lliuraments (comanda_id, estat, cancellat_en) VALUES ($1, 'cancellat', now()) ON CONFLICT (comanda_id) DO NOTHING`, c.OrderID)
			if err != nil || tag.RowsAffected() == 1 {
				return err
			}
			continue // a comanda.pagada committed its row meanwhile: lock that one
		}
		if err != nil {
			return err
		}
		switch state {
		case StateAssigned:
			if courier != nil {
				if _, err := tx.Exec(ctx, `UPDATE repartidors SET ocupat_fins = NULL WHERE id = $1 AND NOT EXISTS (
					SELECT 1 FROM lliuraments WHERE repartidor_id = $1 AND estat = 'assignat' AND comanda_id <> $2 AND assignat_en >= $3)`,
					*courier, c.OrderID, assignedAt); err != nil {
					return err
				}
			}
			_, err = tx.Exec(ctx, `UPDATE lliuraments SET estat = 'cancellat', alliberat = true, cancellat_en = now() WHERE comanda_id = $1`, c.OrderID)
			return err
		case StatePending:
			_, err = tx.Exec(ctx, `UPDATE lliuraments SET estat = 'cancellat', cancellat_en = now() WHERE comanda_id = $1`, c.OrderID)
			return err
		}
		return nil
	}
	return fmt.Errorf("repartiment: cancel %s: the delivery row came and went", c.OrderID)
}

// cancelled reports whether orderID's delivery is cancelled (or tombstoned).
func cancelled(ctx context.Context, tx pgx.Tx, orderID string) (bool, error) {
	var ok bool
	err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM lliuraments WHERE comanda_id = $1 AND estat = 'cancellat')`, orderID).Scan(&ok)
	return ok, err
}
