package comandes

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/tracing"
)

// errUnavailable: pagaments did not answer the authorisation (503).
var errUnavailable = errors.New("pagaments unavailable")

// maxKeyLen bounds the Idempotency-Key header.
const maxKeyLen = 200

// Handler returns the HTTP API:
//
//	POST /comandes        create an order (201 with its capacitat, 400 naming the field or the unknown product, 402, 409, 413, 415,
//	                      422 (codi ciutat_no_coberta: a delivery city repartiment does not cover, before anything is stored or authorised), 503)
//	GET  /comandes/{id}   read an order (200, 400, 401, 404, 503)
//	POST /comandes/{id}/cancellacio   cancel an order (200, the same body for a repeat; 400, 401, 404, 413, 415, 503)
//
// Every error answer is an svc.ErrorBody: an English error, a stable codi
// (svc.Code) and, when one field is at fault, its camp.
//
// The two endpoints of one order need "Authorization: Bearer <credential>":
// the capacitat of the order's 201, or Config.OperatorToken. Without either
// they answer 401 with one body whether or not the order exists (authorize);
// 404 is only ever given to the operator.
//
// Each request runs in a server span (tracing.HTTPHandler) that continues
// the caller's W3C trace context: the order's comanda.creada carries it in
// its outbox row, and every consumer continues it.
func (s *Service) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /comandes", s.postOrder)
	mux.HandleFunc("POST /comandes/{id}/cancellacio", s.postCancel)
	mux.HandleFunc("GET /comandes/{id}", s.getOrder)
	return tracing.HTTPHandler(mux)
}

func (s *Service) postOrder(w http.ResponseWriter, r *http.Request) {
	if !svc.RequireJSON(w, r) {
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			svc.WriteError(w, http.StatusRequestEntityTooLarge, svc.CodeBodyTooLarge, "", fmt.Sprintf("the body is over %d bytes", s.cfg.MaxBodyBytes))
			return
		}
		svc.WriteError(w, http.StatusBadRequest, svc.CodeUnreadableBody, "", "could not read the body: "+err.Error())
		return
	}
	o, ferr := DecodeOrder(body)
	if ferr == nil {
		ferr = Validate(o, s.cfg.Markets)
	}
	if ferr == nil {
		ferr = s.checkProducts(o)
	}
	if ferr != nil {
		svc.WriteFieldError(w, ferr)
		return
	}
	if err := s.checkCoverage(r.Context(), o); err != nil {
		var nc *errNotCovered
		if errors.As(err, &nc) {
			writeNotCovered(w, nc)
			return
		}
		if r.Context().Err() == nil {
			s.cfg.Logger.Error("comandes: check coverage", "comanda", o.ID, "err", err)
		}
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "could not check the delivery city; try again")
		return
	}
	key := r.Header.Get("Idempotency-Key")
	if len(key) > maxKeyLen {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidIdempotencyKey, "Idempotency-Key", fmt.Sprintf("more than %d characters", maxKeyLen))
		return
	}
	if !storable(key) {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidIdempotencyKey, "Idempotency-Key", "must be valid UTF-8")
		return
	}
	a, err := s.create(r.Context(), o, key, body)
	switch {
	case errors.Is(err, errDuplicateID):
		svc.WriteError(w, http.StatusConflict, svc.CodeOrderExists, "id", "an order "+o.ID+" already exists")
		return
	case errors.Is(err, ErrAuthConflict):
		// Not stored under the Idempotency-Key, and not a 503: retrying the
		// same request cannot succeed while pagaments holds the other one.
		s.cfg.Logger.Warn("comandes: authorisation conflict: pagaments holds another request for this order id", "comanda", o.ID)
		svc.WriteError(w, http.StatusConflict, svc.CodeAuthorisationConflict, "id", "pagaments already holds another authorisation for order "+o.ID+"; nothing was stored")
		return
	case errors.Is(err, errUnavailable):
		w.Header().Set("Retry-After", "1")
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", err.Error())
		return
	case err != nil:
		if r.Context().Err() == nil { // else the client has gone
			s.cfg.Logger.Error("comandes: create", "comanda", o.ID, "err", err)
		}
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "could not store the order; try again with the same Idempotency-Key")
		return
	}
	if a.Replay {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.Header().Set("Cache-Control", "no-store") // a 201 carries the capability
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(a.Status)
	_, _ = w.Write(a.Body)
}

// DecodeOrder parses a POST /comandes body strictly (svc.DecodeJSON):
// unknown members are ignored; bad JSON, invalid UTF-8 or a lone surrogate
// escape, a repeated member, a member named like a field but for case, and
// members of the wrong type are a *svc.FieldError naming the member.
func DecodeOrder(body []byte) (*Order, error) {
	var o Order
	if err := svc.DecodeJSON(body, &o); err != nil {
		return nil, err
	}
	return &o, nil
}

// OrderView is the answer of GET /comandes/{id}.
type OrderView struct {
	Order
	State      string     `json:"estat"`
	TotalCents int64      `json:"import_centims"`
	CreatedAt  time.Time  `json:"creat_en"`
	PaidAt     *time.Time `json:"pagada_en,omitempty"`
	// CancelledAt and CancelReason are set once the order is cancelled.
	CancelledAt  *time.Time `json:"cancellada_en,omitempty"`
	CancelReason *string    `json:"motiu_cancellacio,omitempty"`
}

func (s *Service) getOrder(w http.ResponseWriter, r *http.Request) {
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
	v, err := s.Get(r.Context(), id)
	if errors.Is(err, pgx.ErrNoRows) {
		svc.WriteError(w, http.StatusNotFound, svc.CodeUnknownOrder, "id", "no order "+id)
		return
	}
	if err != nil {
		s.cfg.Logger.Error("comandes: get", "comanda", id, "err", err)
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "could not read the order")
		return
	}
	w.Header().Set("Cache-Control", "no-store") // customer data
	svc.WriteJSON(w, http.StatusOK, v)
}

// Get reads one order with its lines; pgx.ErrNoRows if there is none.
func (s *Service) Get(ctx context.Context, id string) (*OrderView, error) {
	v := &OrderView{}
	var city, postal *string
	err := s.cfg.Pool.QueryRow(ctx, `SELECT id, client, mercat, estat, import_centims, ciutat, codi_postal, creat_en, pagada_en,
		cancellada_en, motiu_cancellacio FROM comandes WHERE id = $1`, id).Scan(&v.ID, &v.Client, &v.Market, &v.State, &v.TotalCents, &city, &postal, &v.CreatedAt, &v.PaidAt,
		&v.CancelledAt, &v.CancelReason)
	if err != nil {
		return nil, err
	}
	if city != nil {
		v.Address = &Address{City: *city, PostalCode: deref(postal)}
	}
	rows, err := s.cfg.Pool.Query(ctx, `SELECT producte, quantitat, preu_centims FROM linies_comanda WHERE comanda_id = $1 ORDER BY linia`, id)
	if err != nil {
		return nil, err
	}
	v.Lines, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (Line, error) {
		var l Line
		err := row.Scan(&l.Product, &l.Quantity, &l.PriceCents)
		return l, err
	})
	return v, err
}
