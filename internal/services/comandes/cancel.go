package comandes

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/outcome"
)

// Cancellation reasons (motiu of comanda.cancellada).
const (
	// ReasonClient is the default motiu of POST /comandes/{id}/cancellacio.
	ReasonClient = "client"
)

// Cancelled is the dades of comanda.cancellada (schemas/comanda.cancellada/v1.json).
type Cancelled struct {
	OrderID    string `json:"comanda_id"`
	Reason     string `json:"motiu"`
	Detail     string `json:"detall,omitempty"`
	Previous   string `json:"estat_anterior,omitempty"` // creada or pagada
	TotalCents int64  `json:"import_centims"`
	Market     string `json:"mercat,omitempty"`
}

// Cancellation is the answer of POST /comandes/{id}/cancellacio: the same
// body for the first cancellation and for every repeat.
type Cancellation struct {
	ID      string `json:"id"`
	State   string `json:"estat"` // cancellada
	Reason  string `json:"motiu"`
	EventID string `json:"id_esdeveniment"` // of comanda.cancellada
}

// CancelRequest is the optional body of POST /comandes/{id}/cancellacio.
type CancelRequest struct {
	Reason string `json:"motiu"` // default ReasonClient; checkReason: at most MaxReasonBytes, no control, format or separator characters
}

// MaxReasonBytes bounds the motiu of POST /comandes/{id}/cancellacio.
const MaxReasonBytes = 200

// checkReason refuses a motiu longer than MaxReasonBytes, not valid UTF-8,
// or with a character that is invisible or moves text around when shown:
// controls (Cc), format characters (Cf: the bidi overrides and isolates,
// zero-width characters) and line or paragraph separators (Zl, Zp).
func checkReason(r string) error {
	if len(r) > MaxReasonBytes || !utf8.ValidString(r) {
		return fmt.Errorf("at most %d bytes of UTF-8", MaxReasonBytes)
	}
	if i := strings.IndexFunc(r, func(c rune) bool { return unicode.In(c, unicode.Cc, unicode.Cf, unicode.Zl, unicode.Zp) }); i >= 0 {
		c, _ := utf8.DecodeRuneInString(r[i:])
		return fmt.Errorf("character %U at byte %d: no control, format (bidi, zero-width) or separator characters", c, i)
	}
	return nil
}

// errNoOrder: no order with this id.
var errNoOrder = errors.New("comandes: no such order")

// Cancel cancels order id in a transaction of its own: see CancelTx.
func (s *Service) Cancel(ctx context.Context, id, reason, detail string) (Cancellation, error) {
	var c Cancellation
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		var err error
		c, err = s.CancelTx(ctx, tx, id, reason, detail)
		return err
	})
	return c, err
}

// CancelTx cancels order id in tx: it locks the order's row, sets estat =
// 'cancellada' (from creada or pagada) and writes comanda.cancellada through
// the outbox, both in tx (transactional outbox). An order already cancelled
// changes nothing and returns the first cancellation (its motiu and event),
// whatever reason says: cancelling is idempotent. An unknown id is an error
// wrapping pgx.ErrNoRows.
func (s *Service) CancelTx(ctx context.Context, tx pgx.Tx, id, reason, detail string) (Cancellation, error) {
	var (
		state, market   string
		total           int64
		stored, reason0 *string
	)
	err := tx.QueryRow(ctx, `SELECT estat, mercat, import_centims, esdeveniment_cancellacio, motiu_cancellacio FROM comandes WHERE id = $1 FOR UPDATE`, id).
		Scan(&state, &market, &total, &stored, &reason0)
	if errors.Is(err, pgx.ErrNoRows) {
		return Cancellation{}, fmt.Errorf("%w: %s: %w", errNoOrder, id, err)
	}
	if err != nil {
		return Cancellation{}, err
	}
	if state == StateCancelled {
		return Cancellation{ID: id, State: StateCancelled, Reason: deref(reason0), EventID: deref(stored)}, nil
	}
	ev := &outbox.Event{Aggregate: Aggregate, AggregateID: id, Type: TypeCancelled, Version: 1,
		Payload: Cancelled{OrderID: id, Reason: reason, Detail: clipBytes(detail, 200), Previous: state, TotalCents: total, Market: market}}
	if err := s.cfg.Outbox.Enqueue(ctx, tx, ev); err != nil {
		return Cancellation{}, err
	}
	if _, err := tx.Exec(ctx, `UPDATE comandes SET estat = 'cancellada', cancellada_en = now(), motiu_cancellacio = $2, esdeveniment_cancellacio = $3 WHERE id = $1`,
		id, reason, ev.ID.String()); err != nil {
		return Cancellation{}, err
	}
	return Cancellation{ID: id, State: StateCancelled, Reason: reason, EventID: ev.ID.String()}, nil
}

// State names of comandes.estat.
const (
	StateCreated   = "creada"
	StatePaid      = "pagada"
	StateCancelled = "cancellada"
)

// postCancel is POST /comandes/{id}/cancellacio: 200 with the Cancellation
// (the same body for a repeat), 400 for a bad id or body, 401 without the
// order's capability or the operator token (before the body is read, the
// same for an unknown order), 404 for an unknown order (the operator's
// answer), 415 unless application/json (like every POST: a browser cannot
// send it cross-site without a preflight), 503 if it could not be stored.
func (s *Service) postCancel(w http.ResponseWriter, r *http.Request) {
	if !svc.RequireJSON(w, r) {
		return
	}
	id := r.PathValue("id")
	if !idRE.MatchString(id) {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidID, "id", fmt.Sprintf("%q is not of the form P-YYYY-NNNNNN", clip(id)))
		return
	}
	if err := s.authorize(r.Context(), r, id); err != nil {
		if !errors.Is(err, errUnauthorized) {
			s.cfg.Logger.Error("comandes: authorize", "comanda", id, "err", err)
			svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "could not check the credential; try again")
			return
		}
		writeUnauthorized(w)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 4096))
	if err != nil {
		svc.WriteError(w, http.StatusRequestEntityTooLarge, svc.CodeBodyTooLarge, "", "the body is over 4096 bytes")
		return
	}
	req := CancelRequest{}
	if len(strings.TrimSpace(string(body))) > 0 {
		if err := svc.DecodeJSON(body, &req); err != nil {
			svc.WriteFieldError(w, err)
			return
		}
	}
	if req.Reason == "" {
		req.Reason = ReasonClient
	}
	if err := checkReason(req.Reason); err != nil {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidField, "motiu", err.Error())
		return
	}
	c, err := s.Cancel(r.Context(), id, req.Reason, "")
	switch {
	case errors.Is(err, errNoOrder):
		svc.WriteError(w, http.StatusNotFound, svc.CodeUnknownOrder, "id", "no order "+id)
		return
	case err != nil:
		if r.Context().Err() == nil {
			s.cfg.Logger.Error("comandes: cancel", "comanda", id, "err", err)
		}
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "could not cancel the order; try again")
		return
	}
	svc.WriteJSON(w, http.StatusOK, c)
}

// stockRefused is the dades of estoc.refusat.
type stockRefused struct {
	OrderID string `json:"comanda_id"`
	Reason  string `json:"motiu"`
	Detail  string `json:"detall"`
}

// HandleStockRefused is the consumer.Handler of estoc.refusat (consumidor
// ConsumerStockRefused): the compensation of an order inventari cannot
// serve. In the consumer's transaction it cancels the order with the
// refusal's motiu (CancelTx), so comanda.cancellada goes out and pagaments
// refunds the charge. An order already cancelled changes nothing; an unknown
// order or a payload without comanda_id is permanent.
func (s *Service) HandleStockRefused(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var p stockRefused
	if err := strictjson.Unmarshal(m.Envelope.Data, &p); err != nil {
		return outcome.Permanentf("esquema: estoc.refusat: %v", err)
	}
	if p.OrderID == "" || p.Reason == "" {
		return outcome.Permanentf("esquema: estoc.refusat without comanda_id or motiu")
	}
	_, err := s.CancelTx(ctx, tx, p.OrderID, p.Reason, p.Detail)
	if errors.Is(err, errNoOrder) {
		return outcome.Permanentf("comanda_desconeguda: %s", clip(p.OrderID))
	}
	return err
}

// clipBytes cuts s to at most n bytes on a rune boundary.
func clipBytes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
