package passarella

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/services/svc"
)

// RefundRequest is the body of POST /reemborsaments: a whole charge, by its ref.
type RefundRequest struct {
	OrderID    string `json:"comanda_id"`
	ChargeRef  string `json:"ref_cobrament"`
	TotalCents int64  `json:"import_centims"`
}

// Refund is a refund made by the gateway.
type Refund struct {
	Key        string `json:"clau"`
	OrderID    string `json:"comanda_id"`
	ChargeRef  string `json:"ref_cobrament"`
	TotalCents int64  `json:"import_centims"`
	Ref        string `json:"ref"`
	Calls      int    `json:"crides"`
}

var errNoCharge = errors.New("no hi ha cap cobrament amb aquesta ref, o no és d'aquesta comanda i import")

// refund is POST /reemborsaments: Idempotency-Key required; 201, 200
// replayed, 400, 415, 422 (no such charge, another amount or order, or the
// charge refunded under another key), 503. Faults apply as to charges.
func (s *Server) refund(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if !storableID(key) {
		svc.WriteError(w, http.StatusBadRequest, "Idempotency-Key", "obligatòria: fins a 200 bytes d'UTF-8 sense caràcters de control")
		return
	}
	if !svc.RequireJSON(w, r) {
		return
	}
	var req RefundRequest
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 4096))
	if err == nil {
		err = svc.DecodeJSON(body, &req)
	}
	if err != nil || !storableID(req.OrderID) || !storableID(req.ChargeRef) || req.TotalCents < 0 {
		svc.WriteError(w, http.StatusBadRequest, "cos", "s'esperava {comanda_id, ref_cobrament, import_centims ≥ 0}")
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
		svc.WriteError(w, http.StatusServiceUnavailable, "", "passarella no disponible (simulat)")
		return
	}
	rf, created, err := s.recordRefund(r.Context(), key, req)
	switch {
	case errors.Is(err, errNoCharge), errors.Is(err, errMismatch):
		svc.WriteError(w, http.StatusUnprocessableEntity, "ref_cobrament", err.Error())
		return
	case err != nil:
		s.cfg.Logger.Error("passarella: record refund", "key", key, "err", err)
		svc.WriteError(w, http.StatusServiceUnavailable, "", "passarella: error intern")
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

// recordRefund refunds a charge once per key: a repeated key returns the
// stored refund; the charge must exist with this order and amount, and a
// charge refunded under another key is refused.
func (s *Server) recordRefund(ctx context.Context, key string, req RefundRequest) (Refund, bool, error) {
	rf := Refund{Key: key}
	var inserted bool
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		var ok bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+s.table+` WHERE ref = $1 AND comanda_id = $2 AND import_centims = $3)`,
			req.ChargeRef, req.OrderID, req.TotalCents).Scan(&ok); err != nil {
			return err
		}
		if !ok {
			return errNoCharge
		}
		return tx.QueryRow(ctx, `INSERT INTO `+s.refunds+` AS r (clau, ref_cobrament, comanda_id, import_centims, ref) VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT (clau) DO UPDATE SET crides = r.crides + 1
			RETURNING comanda_id, ref_cobrament, import_centims, ref, crides, (xmax = 0)`, key, req.ChargeRef, req.OrderID, req.TotalCents, "re_"+newRef()[3:]).
			Scan(&rf.OrderID, &rf.ChargeRef, &rf.TotalCents, &rf.Ref, &rf.Calls, &inserted)
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23505" { // ref_cobrament: refunded under another key
		return Refund{}, false, fmt.Errorf("%w: ja reemborsat amb una altra clau", errMismatch)
	}
	if err != nil {
		return Refund{}, false, err
	}
	if rf.ChargeRef != req.ChargeRef || rf.OrderID != req.OrderID || rf.TotalCents != req.TotalCents {
		return Refund{}, false, fmt.Errorf("%w (%s)", errMismatch, rf.ChargeRef)
	}
	return rf, inserted, nil
}

// Refunds returns every refund, by key.
func (s *Server) Refunds(ctx context.Context) (map[string]Refund, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT clau, comanda_id, ref_cobrament, import_centims, ref, crides FROM `+s.refunds)
	if err != nil {
		return nil, err
	}
	out := map[string]Refund{}
	var rf Refund
	_, err = pgx.ForEachRow(rows, []any{&rf.Key, &rf.OrderID, &rf.ChargeRef, &rf.TotalCents, &rf.Ref, &rf.Calls}, func() error {
		out[rf.Key] = rf
		return nil
	})
	return out, err
}

// Refund asks the gateway to refund the charge chargeRef of orderID
// (totalCents, the whole charge) under key (the Idempotency-Key). A timeout or
// 5xx wraps ErrUnavailable; a 4xx wraps ErrRefused.
func (c *Client) Refund(ctx context.Context, key, orderID, chargeRef string, totalCents int64) (Refund, error) {
	raw, err := c.post(ctx, "/reemborsaments", key, RefundRequest{OrderID: orderID, ChargeRef: chargeRef, TotalCents: totalCents})
	if err != nil {
		return Refund{}, err
	}
	var rf Refund
	if err := json.Unmarshal(raw, &rf); err != nil || rf.Ref == "" {
		return Refund{}, fmt.Errorf("%w: unreadable answer", ErrUnavailable)
	}
	return rf, nil
}

// post sends body to path with the Idempotency-Key and returns the 2xx body.
func (c *Client) post(ctx context.Context, path, key string, body any) ([]byte, error) {
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = TimeoutDefault
	}
	hc := c.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+path, bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrRefused, err)
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	switch {
	case resp.StatusCode >= 500:
		return nil, fmt.Errorf("%w: HTTP %d", ErrUnavailable, resp.StatusCode)
	case resp.StatusCode >= 400:
		return nil, fmt.Errorf("%w: HTTP %d %s", ErrRefused, resp.StatusCode, bytes.TrimSpace(raw))
	}
	return raw, nil
}
