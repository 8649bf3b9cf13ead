// Package passarella is a simulated payment gateway: a real HTTP server with
// its own storage that honours the Idempotency-Key header like an external
// payment gateway. A repeated key returns the charge already
// made instead of charging again. It can be told to fail (503, before
// charging) or to hang (after charging, before answering) for chosen requests,
// which is how the demo and the tests reproduce the dangerous windows.
package passarella

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/migrate"
)

// SchemaDefault is the schema of the gateway's tables.
const SchemaDefault = "passarella"

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations creates <schema>.cobraments and <schema>.reemborsaments. Apply with migrate.Names{Schema: SchemaDefault}.
var Migrations = migrate.Set{Name: "passarella", FS: sqlFS, Dir: "sql"}

// Faults chooses the requests that fail or hang. attempt counts the requests
// with one key seen by this server process, from 1.
type Faults struct {
	// Fail answers 503 without charging.
	Fail func(key string, attempt int) bool
	// Hang charges, then waits HangFor (or until the client gives up) before answering.
	Hang    func(key string, attempt int) bool
	HangFor time.Duration // default 3 s
}

// APIKeyEnv is the environment variable that holds the API key of an
// external gateway (system.Config.GatewayAPIKey's default).
const APIKeyEnv = "KM0_PASSARELLA_API_KEY"

// APIKeyMinBytes is the shortest API key New accepts.
const APIKeyMinBytes = 32

// ErrShortAPIKey: Config.APIKey is set but shorter than APIKeyMinBytes.
var ErrShortAPIKey = fmt.Errorf("passarella: the API key must have at least %d bytes", APIKeyMinBytes)

// Config configures a Server.
type Config struct {
	Pool   *pgxpool.Pool // migrated with Migrations; required
	Schema string        // default SchemaDefault
	// APIKey is the secret every request must carry as
	// "Authorization: Bearer <key>", as a real gateway's API key: charges,
	// refunds and the list of charges move or show money. Default: a random
	// key made by New (read it with Server.APIKey and give it to the
	// Client). Shorter than APIKeyMinBytes: New fails with ErrShortAPIKey.
	APIKey string
	Faults Faults
	Logger *slog.Logger
}

// Server is the gateway. It is safe for concurrent use.
type Server struct {
	cfg      Config
	keyHash  [sha256.Size]byte
	table    string
	refunds  string
	mu       sync.Mutex
	attempts map[string]int
	stats    Stats
}

// Stats counts the requests the server answered.
type Stats struct {
	Requests, Charged, Replayed, Failed, Hung int
	RefundRequests, Refunded                  int
}

// New returns a Server.
func New(cfg Config) (*Server, error) {
	if cfg.Pool == nil {
		return nil, errors.New("passarella: Config.Pool is required")
	}
	if cfg.Schema == "" {
		cfg.Schema = SchemaDefault
	}
	if cfg.Faults.HangFor <= 0 {
		cfg.Faults.HangFor = 3 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	switch {
	case cfg.APIKey == "":
		cfg.APIKey = rand.Text() + rand.Text() // 256 random bits
	case len(cfg.APIKey) < APIKeyMinBytes:
		return nil, ErrShortAPIKey
	}
	return &Server{cfg: cfg, keyHash: sha256.Sum256([]byte(cfg.APIKey)), table: pgx.Identifier{cfg.Schema, "cobraments"}.Sanitize(),
		refunds: pgx.Identifier{cfg.Schema, "reemborsaments"}.Sanitize(), attempts: map[string]int{}}, nil
}

// APIKey returns the key callers must send (Config.APIKey, or the one New
// made). Never log it.
func (s *Server) APIKey() string { return s.cfg.APIKey }

// authorized reports whether r carries the API key, compared in constant
// time (over hashes, so the key's length does not show either).
func (s *Server) authorized(r *http.Request) bool {
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	got := sha256.Sum256([]byte(token))
	return subtle.ConstantTimeCompare(got[:], s.keyHash[:]) == 1 && ok
}

// requireKey answers 401 to a request without the API key, before its body
// or parameters are looked at.
func (s *Server) requireKey(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !s.authorized(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="passarella"`)
			svc.WriteError(w, http.StatusUnauthorized, svc.CodeCredentialRequired, "Authorization", "the gateway's API key is required: Authorization: Bearer <key>")
			return
		}
		h(w, r)
	}
}

// ChargeRequest is the body of POST /cobraments.
type ChargeRequest struct {
	OrderID    string `json:"comanda_id"`
	TotalCents int64  `json:"import_centims"`
}

// Charge is a charge made by the gateway.
type Charge struct {
	Key        string `json:"clau"`
	OrderID    string `json:"comanda_id"`
	TotalCents int64  `json:"import_centims"`
	Ref        string `json:"ref"`
	Calls      int    `json:"crides"`
}

// Page sizes of GET /cobraments.
const (
	PageLimitDefault = 100
	PageLimitMax     = 1000
)

// Page is the answer of GET /cobraments: charges in key order and, when
// there may be more, the cursor of the next page (Next, "seguent": pass it
// as despres_de).
type Page struct {
	Charges []Charge `json:"cobraments"`
	Next    string   `json:"seguent,omitempty"`
}

// Handler returns the gateway's HTTP API. Every route needs the API key
// (Config.APIKey) as "Authorization: Bearer <key>"; without it: 401, nothing
// charged, refunded or shown.
//
//	POST /cobraments   charge (Idempotency-Key required; application/json; 201, 200 replayed, 400, 415, 422, 503)
//	GET  /cobraments?limit=&despres_de=   one page of charges in key order (Page)
//	POST /reemborsaments   refund a whole charge (Idempotency-Key required; application/json; 201, 200 replayed, 400, 415, 422, 503)
//
// limit defaults to PageLimitDefault and is at most PageLimitMax; despres_de
// is the seguent of the previous page (the key after which to list). Any
// other parameter, or a limit out of range, is a 400.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /cobraments", s.requireKey(s.charge))
	mux.HandleFunc("GET /cobraments", s.requireKey(s.list))
	mux.HandleFunc("POST /reemborsaments", s.requireKey(s.refund))
	return mux
}

func (s *Server) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for k := range q {
		if k != "limit" && k != "despres_de" {
			svc.WriteError(w, http.StatusBadRequest, svc.CodeUnknownParameter, k, "unknown parameter (known: limit, despres_de)")
			return
		}
	}
	limit := PageLimitDefault
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > PageLimitMax {
			svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidField, "limit", fmt.Sprintf("must be an integer from 1 to %d", PageLimitMax))
			return
		}
		limit = n
	}
	after := q.Get("despres_de")
	if len(after) > 200 {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidField, "despres_de", "more than 200 characters")
		return
	}
	cs, next, err := s.ChargesPage(r.Context(), after, limit)
	if err != nil {
		if r.Context().Err() == nil {
			s.cfg.Logger.Error("passarella: list charges", "err", err)
		}
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "passarella: internal error")
		return
	}
	svc.WriteJSON(w, http.StatusOK, Page{Charges: cs, Next: next})
}

// Stats returns the request counters.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// keyedRequest reads r's Idempotency-Key and decodes its JSON body (at
// most 4 KiB) into req. ok is false when it already answered: 400 for a
// missing or unstorable key, 415 for a body that is not JSON; err is a body
// that does not decode, for the caller's own 400.
func keyedRequest(w http.ResponseWriter, r *http.Request, req any) (key string, ok bool, err error) {
	key = r.Header.Get("Idempotency-Key")
	if !storableID(key) {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidIdempotencyKey, "Idempotency-Key", "required: up to 200 bytes of UTF-8 without control characters")
		return "", false, nil
	}
	if !svc.RequireJSON(w, r) {
		return "", false, nil
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 4096))
	if err == nil {
		err = svc.DecodeJSON(body, req)
	}
	return key, true, err
}

func (s *Server) charge(w http.ResponseWriter, r *http.Request) {
	var req ChargeRequest
	key, ok, err := keyedRequest(w, r, &req)
	if !ok {
		return
	}
	if err != nil || req.OrderID == "" || req.TotalCents < 0 {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidField, "cos", "expected {comanda_id, import_centims ≥ 0}")
		return
	}
	// Checked before any SQL: PostgreSQL would refuse it, and a refusal is
	// the caller's bad data (400), not the gateway being down (503).
	if !storableID(req.OrderID) {
		svc.WriteError(w, http.StatusBadRequest, svc.CodeInvalidField, "comanda_id", "up to 200 bytes of UTF-8 without control characters (NUL included)")
		return
	}
	s.mu.Lock()
	s.attempts[key]++
	attempt := s.attempts[key]
	s.stats.Requests++
	fail := s.cfg.Faults.Fail != nil && s.cfg.Faults.Fail(key, attempt)
	hang := !fail && s.cfg.Faults.Hang != nil && s.cfg.Faults.Hang(key, attempt)
	if fail {
		s.stats.Failed++
	}
	s.mu.Unlock()
	if fail {
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "passarella unavailable (simulated)")
		return
	}
	c, created, err := s.record(r.Context(), key, req)
	if errors.Is(err, errMismatch) || errors.Is(err, errVoided) {
		code := svc.CodeIdempotencyKeyReused
		if errors.Is(err, errVoided) {
			code = svc.CodeKeyVoided
		}
		svc.WriteError(w, http.StatusUnprocessableEntity, code, "Idempotency-Key", err.Error())
		return
	}
	if err != nil {
		s.cfg.Logger.Error("passarella: record", "key", key, "err", err)
		svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "passarella: internal error")
		return
	}
	s.mu.Lock()
	if created {
		s.stats.Charged++
	} else {
		s.stats.Replayed++
	}
	if hang {
		s.stats.Hung++
	}
	s.mu.Unlock()
	if hang { // charged, but the answer is late: the client's timeout fires first
		select {
		case <-time.After(s.cfg.Faults.HangFor):
		case <-r.Context().Done():
			return
		}
	}
	status := http.StatusCreated
	if !created {
		status = http.StatusOK
		w.Header().Set("Idempotent-Replayed", "true")
	}
	svc.WriteJSON(w, status, c)
}

// storableID reports whether s is a key the gateway stores: 1 to 200 bytes
// of valid UTF-8 without control characters (NUL included).
func storableID(s string) bool {
	return s != "" && len(s) <= 200 && utf8.ValidString(s) && strings.IndexFunc(s, unicode.IsControl) < 0
}

var errMismatch = errors.New("the key was already used for another charge")

// record charges once per key: a repeated key returns the stored charge.
func (s *Server) record(ctx context.Context, key string, req ChargeRequest) (Charge, bool, error) {
	ref := newRef()
	c := Charge{Key: key}
	var inserted bool
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		// Under the key's lock: a key voided by a refund charges nothing.
		var voided bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+s.refunds+` WHERE clau_cobrament = $2 AND ref_cobrament IS NULL)
			FROM pg_advisory_xact_lock($1, hashtext($2))`, keyLockClass, key).Scan(&voided); err != nil {
			return err
		}
		if voided {
			return errVoided
		}
		return tx.QueryRow(ctx, `INSERT INTO `+s.table+` AS c (clau, comanda_id, import_centims, ref) VALUES ($1, $2, $3, $4)
			ON CONFLICT (clau) DO UPDATE SET crides = c.crides + 1
			RETURNING comanda_id, import_centims, ref, crides, (xmax = 0)`, key, req.OrderID, req.TotalCents, ref).
			Scan(&c.OrderID, &c.TotalCents, &c.Ref, &c.Calls, &inserted)
	})
	if err != nil {
		return Charge{}, false, err
	}
	if c.OrderID != req.OrderID || c.TotalCents != req.TotalCents {
		return Charge{}, false, fmt.Errorf("%w (%s, %d)", errMismatch, c.OrderID, c.TotalCents)
	}
	return c, inserted, nil
}

// Charges returns every charge, by key.
func (s *Server) Charges(ctx context.Context) (map[string]Charge, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT clau, comanda_id, import_centims, ref, crides FROM `+s.table)
	if err != nil {
		return nil, err
	}
	out := map[string]Charge{}
	var c Charge
	_, err = pgx.ForEachRow(rows, []any{&c.Key, &c.OrderID, &c.TotalCents, &c.Ref, &c.Calls}, func() error {
		out[c.Key] = c
		return nil
	})
	return out, err
}

// ChargesPage returns up to limit charges whose key sorts after after ("":
// from the first), in key order, and the cursor of the next page: the last
// key returned when more charges follow, else "".
func (s *Server) ChargesPage(ctx context.Context, after string, limit int) ([]Charge, string, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT clau, comanda_id, import_centims, ref, crides FROM `+s.table+`
		WHERE clau > $1 ORDER BY clau LIMIT $2`, after, limit+1)
	if err != nil {
		return nil, "", err
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Charge, error) {
		var c Charge
		err := row.Scan(&c.Key, &c.OrderID, &c.TotalCents, &c.Ref, &c.Calls)
		return c, err
	})
	if err != nil {
		return nil, "", err
	}
	next := ""
	if len(out) > limit {
		out = out[:limit]
		next = out[limit-1].Key
	}
	return out, next, nil
}

func newRef() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return "ch_" + hex.EncodeToString(b)
}
