// Package pgtest gives each test its own PostgreSQL schema or database on the
// machine's real server, and drops it when the test ends. A server that does not
// answer is a test failure naming PostgreSQL, never a skip.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/migrate"
)

// URL is the server tests use: KM0_TEST_DATABASE_URL, else the local trust-auth
// server of the machine.
func URL() string {
	if u := os.Getenv("KM0_TEST_DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// Schema is a per-test schema.
type Schema struct {
	Name string        // the schema, e.g. t_3fa9c1d2e4b5
	URL  string        // a URL whose search_path is the schema
	Pool *pgxpool.Pool // at most 6 connections, search_path set
}

// Names returns migrate.Names for the schema with the contract's table names.
func (s *Schema) Names() migrate.Names { return migrate.Names{Schema: s.Name}.WithDefaults() }

func randName(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// NewSchema creates an empty schema and a pool bound to it; both go at cleanup.
func NewSchema(t testing.TB) *Schema {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	admin := connect(t, ctx, URL())
	name := randName("t_")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("pgtest: create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("pgtest: drop schema %s: %v", name, err)
		}
		admin.Close(ctx)
	})
	u := withParam(URL(), "search_path", name)
	pool := NewPool(t, u, 6)
	return &Schema{Name: name, URL: u, Pool: pool}
}

// NewMigratedSchema is NewSchema with the outbox and inbox migrations applied.
func NewMigratedSchema(t testing.TB) *Schema {
	t.Helper()
	s := NewSchema(t)
	if _, err := migrate.Up(context.Background(), s.Pool, s.Names(), migrate.Outbox, migrate.Inbox); err != nil {
		t.Fatalf("pgtest: migrate: %v", err)
	}
	return s
}

// NewDatabase creates an empty database and returns its URL; it is dropped
// (WITH FORCE) at cleanup.
func NewDatabase(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin := connect(t, ctx, URL())
	name := randName("km0t_")
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("pgtest: create database: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
		admin.Close(ctx)
	})
	return WithDatabase(URL(), name)
}

// NewPool opens a pool of at most maxConns connections, closed at cleanup.
func NewPool(t testing.TB, connURL string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connURL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func connect(t testing.TB, ctx context.Context, u string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatalf("PostgreSQL is required and did not answer at %s: %v "+
			"(start it with: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start)", redact.URL(u), err)
	}
	return conn
}

// WithDatabase returns u with its database path replaced by name.
func WithDatabase(u, name string) string {
	pu, err := url.Parse(u)
	if err != nil {
		return u
	}
	pu.Path = "/" + name
	return pu.String()
}

func withParam(u, key, value string) string {
	pu, err := url.Parse(u)
	if err != nil {
		return u
	}
	q := pu.Query()
	q.Set(key, value)
	pu.RawQuery = q.Encode()
	return pu.String()
}

// Temp creates an empty schema and a pool bound to it for code that has no
// testing.TB (runnable examples); drop closes the pool and drops the schema.
func Temp(ctx context.Context) (s *Schema, drop func(), err error) {
	admin, err := pgx.Connect(ctx, URL())
	if err != nil {
		return nil, nil, fmt.Errorf("PostgreSQL is required and did not answer at %s: %w", redact.URL(URL()), err)
	}
	name := randName("t_")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		admin.Close(ctx)
		return nil, nil, fmt.Errorf("pgtest: create schema: %w", err)
	}
	u := withParam(URL(), "search_path", name)
	pool, err := pgxpool.New(ctx, u)
	if err == nil {
		err = pool.Ping(ctx)
	}
	drop = func() {
		if pool != nil {
			pool.Close()
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE")
		admin.Close(ctx)
	}
	if err != nil {
		drop()
		return nil, nil, fmt.Errorf("pgtest: pool: %w", err)
	}
	return &Schema{Name: name, URL: u, Pool: pool}, drop, nil
}
