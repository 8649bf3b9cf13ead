// Package svc holds what the km0 services share: their database (one per
// service, km0_<service>, created if absent), a small connection pool, and the
// JSON helpers and request checks (strict bodies, JSON-only POSTs, the Host
// check) of their HTTP APIs.
package svc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/migrate"
)

// MaxConnsDefault caps each service's pool: six services share a server whose
// max_connections is typically 100.
const MaxConnsDefault = 5

// DatabaseName returns km0_<service>, with "_<suffix>" appended when suffix is
// not empty (the demo uses a fresh suffix per run).
func DatabaseName(service, suffix string) string {
	if suffix == "" {
		return "km0_" + service
	}
	return "km0_" + service + "_" + suffix
}

// WithDatabase returns the connection string base with its database
// replaced by name, every other setting kept: host, user, and the TLS
// parameters (sslmode, sslrootcert, sslcert, sslkey), so that a derived
// km0_<service> database is reached as securely as base. base is a URL
// (postgres://, postgresql://) or a keyword/value DSN ("host=... sslmode=..."),
// whose later dbname overrides an earlier one. It fails on an unparseable
// base without echoing it (it may hold a password).
func WithDatabase(base, name string) (string, error) {
	unparseable := errors.New("unparseable database URL (not shown: it may hold a password)")
	if !strings.HasPrefix(base, "postgres://") && !strings.HasPrefix(base, "postgresql://") {
		// Not parsed here: pgconn.ParseConfig reads the TLS files, and the
		// connection reports their errors.
		if !strings.Contains(base, "=") {
			return "", unparseable
		}
		return strings.TrimSpace(base) + " dbname='" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(name) + "'", nil
	}
	u, err := url.Parse(base)
	if err != nil {
		return "", unparseable
	}
	u.Path = "/" + name
	u.RawPath = ""
	return u.String(), nil
}

// EnsureDatabase creates database name on the server of base if it does not
// exist and returns its URL. Two processes racing to create it both succeed.
func EnsureDatabase(ctx context.Context, base, name string) (string, error) {
	target, err := WithDatabase(base, name)
	if err != nil {
		return "", err
	}
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		return "", fmt.Errorf("connect to %s: %w", redact.URL(base), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return "", fmt.Errorf("look up database %s: %w", name, err)
	}
	if exists {
		return target, nil
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		var pgErr *pgconn.PgError
		// 42P04 duplicate_database, 23505: another process won the race.
		if errors.As(err, &pgErr) && (pgErr.Code == "42P04" || pgErr.Code == "23505") {
			return target, nil
		}
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return target, nil
}

// DropDatabase drops database name on the server of base (WITH FORCE), if it exists.
func DropDatabase(ctx context.Context, base, name string) error {
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", redact.URL(base), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// OpenPool opens a pool of at most maxConns connections (MaxConnsDefault when
// ≤ 0) and checks that the server answers.
func OpenPool(ctx context.Context, connURL string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(connURL)
	if err != nil {
		return nil, errors.New("invalid database URL (not shown: it may hold a password)")
	}
	if maxConns <= 0 {
		maxConns = MaxConnsDefault
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("pool %s: %w", redact.URL(connURL), err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("database %s does not answer: %w", redact.URL(connURL), err)
	}
	return pool, nil
}

// Migrate applies sets to db with CONTRACT.md's default names (schema public).
func Migrate(ctx context.Context, db contract.Beginner, sets ...migrate.Set) error {
	if _, err := migrate.Up(ctx, db, migrate.Names{}, sets...); err != nil {
		return err
	}
	return nil
}

// FieldError is a 400 answer naming the offending field (WriteFieldError).
type FieldError struct {
	Field  string // e.g. "linies[0].quantitat"
	Reason string
	// Code is the answer's codi; the zero Code is CodeInvalidField.
	Code Code
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Reason }

// Fieldf returns a *FieldError.
func Fieldf(field, format string, args ...any) *FieldError {
	return &FieldError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// DecodeJSON decodes a request body into v strictly (see
// internal/strictjson): invalid UTF-8 or an escaped lone surrogate in any
// string, two members of one name, a member that matches a field only when
// case is ignored, malformed JSON and a value of the wrong type are each a
// *FieldError naming the member ("cos" for the body as a whole). Unknown
// members are ignored.
func DecodeJSON(body []byte, v any) error {
	if err := strictjson.Unmarshal(body, v); err != nil {
		var se *strictjson.Error
		if errors.As(err, &se) && se.Path != "" {
			return &FieldError{Field: se.Path, Reason: se.Reason}
		}
		return &FieldError{Field: "cos", Reason: err.Error()}
	}
	return nil
}

// RequireJSON reports whether r declares a JSON body: Content-Type
// application/json, with at most a charset parameter of utf-8. If not, it
// answers 415 and returns false. State-changing endpoints call it first: a
// web page can make a browser send a cross-site POST without asking the
// server first (a CORS preflight) only as text/plain, a form or multipart,
// so refusing those keeps other sites from posting to the API.
func RequireJSON(w http.ResponseWriter, r *http.Request) bool {
	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	utf8Only := len(params) == 0 || (len(params) == 1 && strings.EqualFold(params["charset"], "utf-8"))
	if err != nil || mt != "application/json" || !utf8Only {
		WriteError(w, http.StatusUnsupportedMediaType, CodeNotJSON, "Content-Type", "the body must be application/json (UTF-8)")
		return false
	}
	return true
}

// WriteJSON writes v as JSON with status.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// GetJSON returns a handler serving GET pattern with the JSON of read's
// result; a read error answers 503 (CodeUnavailable) with failMsg (the
// error is not shown).
func GetJSON(pattern, failMsg string, read func(ctx context.Context) (any, error)) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+pattern, func(w http.ResponseWriter, r *http.Request) {
		v, err := read(r.Context())
		if err != nil {
			WriteError(w, http.StatusServiceUnavailable, CodeUnavailable, "", failMsg)
			return
		}
		WriteJSON(w, http.StatusOK, v)
	})
	return mux
}
