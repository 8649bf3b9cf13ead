package passarella

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/internal/services/svc"
)

// RefundRequest is the body of POST /reemborsaments: the whole charge made
// under the Idempotency-Key ChargeKey.
type RefundRequest struct {
	OrderID   string `json:"comanda_id"`
	ChargeKey string `json:"clau_cobrament"`
}

// Refund is a refund made by the gateway. Void: there was no charge under
// the key; nothing was refunded and the key is void (a later charge with it
// is refused).
type Refund struct {
	Key        string `json:"clau"`
	OrderID    string `json:"comanda_id"`
	ChargeKey  string `json:"clau_cobrament"`
	ChargeRef  string `json:"ref_cobrament,omitempty"`
	TotalCents int64  `json:"import_centims"`
	Ref        string `json:"ref"`
	Calls      int    `json:"crides"`
	Void       bool   `json:"anul·lat"`
}

var errNoCharge = errors.New("the charge of this key is another order's")

// errVoided: a charge under a key whose refund voided it.
var errVoided = errors.New("this charge's key was voided (order cancelled)")

// keyLockClass is the first key of the advisory lock that serialises a
// charge and a refund of one charge key.
const keyLockClass = 0x706173 // "pas"

// refund is POST /reemborsaments: Idempotency-Key required; 201, 200
// replayed, 400, 415, 422 (the charge key is another order's, or was
// refunded under another key), 503. Faults apply as to charges.
func (s *Server) refund(w http.ResponseWriter, r *http.Request) {
	var req RefundRequest
	key, ok, err := keyedRequest(w, r, &req)
	if !ok {
		return
	}
	if err != nil || !storableID(req.OrderID) || !storableID(req.ChargeKey) {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidField, "cos", "expected {comanda_id, clau_cobrament}")
		return
	}
	s.mu.Lock()
	s.attempts[key]++
	attempt := s.attempts[key]
	fail := s.cfg.Faults.Fail != nil && s.cfg.Faults.Fail(key, attempt)
	s.stats.RefundRequests++
	if fail {
		s.stats.Failed++
	}
	s.mu.Unlock()
	if fail {
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "passarella unavailable (simulated)")
		return
	}
	rf, created, err := s.recordRefund(r.Context(), key, req)
	switch {
	case errors.Is(err, errNoCharge), errors.Is(err, errMismatch):
		svc.WriteError(w, http.StatusUnprocessableEntity, svc.CodeRefundRefused, "clau_cobrament", err.Error())
		return
	case err != nil:
		s.cfg.Logger.Error("passarella: record refund", "key", key, "err", err)
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "passarella: internal error")
		return
	}
	s.mu.Lock()
	if created {
		s.stats.Refunded++
	}
	s.mu.Unlock()
	status := http.StatusCreated
	if !created {
		status = http.StatusOK
		w.Header().Set("Idempotent-Replayed", "true")
	}
	svc.WriteJSON(w, status, rf)
}

// recordRefund refunds the charge of req.ChargeKey once per key: a
// repeated key returns the stored refund; a charge key refunded under
// another key is refused; a charge key with no charge is voided.
func (s *Server) recordRefund(ctx context.Context, key string, req RefundRequest) (Refund, bool, error) {
	rf := Refund{Key: key}
	var inserted bool
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1, hashtext($2))`, keyLockClass, req.ChargeKey); err != nil {
			return err
		}
		var (
			orderID, ref *string
			cents        int64
		)
		err := tx.QueryRow(ctx, `SELECT comanda_id, ref, import_centims FROM `+s.table+` WHERE clau = $1`, req.ChargeKey).Scan(&orderID, &ref, &cents)
		if errors.Is(err, pgx.ErrNoRows) {
			orderID, ref, cents = &req.OrderID, nil, 0 // nothing charged: void the key
		} else if err != nil {
			return err
		}
		if *orderID != req.OrderID {
			return errNoCharge
		}
		var chargeRef *string
		err = tx.QueryRow(ctx, `INSERT INTO `+s.refunds+` AS r (clau, clau_cobrament, ref_cobrament, comanda_id, import_centims, ref) VALUES ($1, $2, $3, $4, $5, $6)
			ON CONFLICT (clau) DO UPDATE SET crides = r.crides + 1
			RETURNING comanda_id, clau_cobrament, ref_cobrament, import_centims, ref, crides, (xmax = 0)`, key, req.ChargeKey, ref, req.OrderID, cents, "re_"+newRef()[3:]).
			Scan(&rf.OrderID, &rf.ChargeKey, &chargeRef, &rf.TotalCents, &rf.Ref, &rf.Calls, &inserted)
		if chargeRef != nil {
			rf.ChargeRef = *chargeRef
		}
		rf.Void = chargeRef == nil
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23505" { // clau_cobrament: refunded under another key
		return Refund{}, false, fmt.Errorf("%w: already refunded with another key", errMismatch)
	}
	if err != nil {
		return Refund{}, false, err
	}
	if rf.ChargeKey != req.ChargeKey || rf.OrderID != req.OrderID {
		return Refund{}, false, fmt.Errorf("%w (%s)", errMismatch, rf.ChargeKey)
	}
	return rf, inserted, nil
}

// Refunds returns every refund, by key.
func (s *Server) Refunds(ctx context.Context) (map[string]Refund, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT clau, comanda_id, clau_cobrament, coalesce(ref_cobrament, ''), ref_cobrament IS NULL, import_centims, ref, crides FROM `+s.refunds)
	if err != nil {
		return nil, err
	}
	out := map[string]Refund{}
	var rf Refund
	_, err = pgx.ForEachRow(rows, []any{&rf.Key, &rf.OrderID, &rf.ChargeKey, &rf.ChargeRef, &rf.Void, &rf.TotalCents, &rf.Ref, &rf.Calls}, func() error {
		out[rf.Key] = rf
		return nil
	})
	return out, err
}

// Refund asks the gateway to refund the whole charge made for orderID under
// chargeKey, with key as the refund's Idempotency-Key; with no such charge
// the answer is Void and the charge key can no longer charge. A timeout or
// 5xx wraps ErrUnavailable; a 4xx wraps ErrRefused.
func (c *Client) Refund(ctx context.Context, key, orderID, chargeKey string) (Refund, error) {
	raw, err := c.post(ctx, "/reemborsaments", key, RefundRequest{OrderID: orderID, ChargeKey: chargeKey})
	if err != nil {
		return Refund{}, err
	}
	var rf Refund
	if err := json.Unmarshal(raw, &rf); err != nil || rf.Ref == "" {
		return Refund{}, fmt.Errorf("%w: unreadable answer", ErrUnavailable)
	}
	return rf, nil
}
