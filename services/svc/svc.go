// Package svc holds what the km0 services share: their database (one per
// service, km0_<service>, created if absent), a small connection pool, and the
// JSON helpers of their HTTP APIs.
package svc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

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

// WithDatabase returns the URL base with its database replaced by name. It
// fails on an unparseable URL without echoing it (it may hold a password).
func WithDatabase(base, name string) (string, error) {
	u, err := url.Parse(base)
	if err != nil {
		return "", errors.New("svc: unparseable database URL (not shown: it may hold a password)")
	}
	u.Path = "/" + name
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
		return "", fmt.Errorf("svc: connect to %s: %w", Redact(base), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return "", fmt.Errorf("svc: look up database %s: %w", name, err)
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
		return "", fmt.Errorf("svc: create database %s: %w", name, err)
	}
	return target, nil
}

// DropDatabase drops database name on the server of base (WITH FORCE), if it exists.
func DropDatabase(ctx context.Context, base, name string) error {
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		return fmt.Errorf("svc: connect to %s: %w", Redact(base), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("svc: drop database %s: %w", name, err)
	}
	return nil
}

// OpenPool opens a pool of at most maxConns connections (MaxConnsDefault when
// ≤ 0) and checks that the server answers.
func OpenPool(ctx context.Context, connURL string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(connURL)
	if err != nil {
		return nil, errors.New("svc: invalid database URL (not shown: it may hold a password)")
	}
	if maxConns <= 0 {
		maxConns = MaxConnsDefault
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("svc: pool %s: %w", Redact(connURL), err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("svc: database %s does not answer: %w", Redact(connURL), err)
	}
	return pool, nil
}

// Migrate applies sets to db with CONTRACT.md's default names (schema public).
func Migrate(ctx context.Context, db migrate.DBTX, sets ...migrate.Set) error {
	if _, err := migrate.Up(ctx, db, migrate.Names{}, sets...); err != nil {
		return err
	}
	return nil
}

// Redact hides the password of a connection string: in the user info or a
// password/sslpassword parameter of a URL; a keyword/value DSN is shown as
// postgres://user@host:port/database only.
func Redact(u string) string {
	pu, err := url.Parse(u)
	if err != nil || pu.Scheme == "" {
		if c, err := pgconn.ParseConfig(u); err == nil {
			return fmt.Sprintf("postgres://%s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
		}
		return "<unparseable URL>"
	}
	q := pu.Query()
	for _, k := range []string{"password", "sslpassword"} {
		if q.Has(k) {
			q.Set(k, "xxxxx")
			pu.RawQuery = q.Encode()
		}
	}
	return pu.Redacted()
}

// FieldError is a 400 answer naming the offending field.
type FieldError struct {
	Field  string // e.g. "linies[0].quantitat"
	Reason string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Reason }

// Fieldf returns a *FieldError.
func Fieldf(field, format string, args ...any) *FieldError {
	return &FieldError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// WriteJSON writes v as JSON with status.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// ErrorBody is the JSON body of every error answer.
type ErrorBody struct {
	Error string `json:"error"`
	Field string `json:"camp,omitempty"`
}

// WriteError writes {"error": msg, "camp": field} with status.
func WriteError(w http.ResponseWriter, status int, field, msg string) {
	WriteJSON(w, status, ErrorBody{Error: msg, Field: field})
}

// GetJSON returns a handler serving GET pattern with the JSON of read's
// result; a read error answers 503 with failMsg (the error is not shown).
func GetJSON(pattern, failMsg string, read func(ctx context.Context) (any, error)) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+pattern, func(w http.ResponseWriter, r *http.Request) {
		v, err := read(r.Context())
		if err != nil {
			WriteError(w, http.StatusServiceUnavailable, "", failMsg)
			return
		}
		WriteJSON(w, http.StatusOK, v)
	})
	return mux
}
