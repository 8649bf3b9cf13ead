// Package svctest helps the services' tests: a migrated per-test database on
// the real PostgreSQL, a consumer.Message built from an envelope, and running
// a handler in a real transaction.
package svctest

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
	"github.com/km0/km0/transport"
)

// DB creates a per-test database, applies sets and returns a pool of at most
// 4 connections and the database URL; both go at cleanup.
func DB(t testing.TB, sets ...migrate.Set) (*pgxpool.Pool, string) {
	t.Helper()
	u := pgtest.NewDatabase(t)
	pool := pgtest.NewPool(t, u, 4)
	if _, err := migrate.Up(context.Background(), pool, migrate.Names{}, sets...); err != nil {
		t.Fatalf("svctest: migrate: %v", err)
	}
	return pool, u
}

// Message returns a first delivery of an event with a fresh id_esdeveniment.
func Message(t testing.TB, topic, tipus string, versio int, dades any) *consumer.Message {
	t.Helper()
	raw, err := json.Marshal(dades)
	if err != nil {
		t.Fatal(err)
	}
	env := &envelope.Envelope{ID: uuid.NewString(), Type: tipus, Version: versio, TimeMS: 1, Origin: "test", Data: raw}
	value, err := env.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return &consumer.Message{
		Message:  &transport.Message{Topic: topic, Value: value, Headers: []transport.Header{{Key: contract.HeaderType, Value: tipus}, {Key: contract.HeaderEventID, Value: env.ID}}},
		Envelope: env,
		Attempt:  1,
	}
}

// Run runs h on m in a transaction of pool and commits it if h returns nil
// (rolling back otherwise), as the consumer does; it returns h's error.
func Run(t testing.TB, pool *pgxpool.Pool, h consumer.Handler, m *consumer.Message) error {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if herr := h(ctx, tx, m); herr != nil {
		_ = tx.Rollback(ctx)
		return herr
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return nil
}

// Count runs a count(*) query.
func Count(t testing.TB, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// Outbox returns an outbox that validates every event against the published
// schemas (schemas/), as the running system does: a service test then also
// proves that what the service writes matches the contract.
func Outbox(t testing.TB) *outbox.Outbox {
	t.Helper()
	reg, err := schema.Default()
	if err != nil {
		t.Fatalf("svctest: schemas: %v", err)
	}
	return outbox.New(outbox.Config{Validate: reg.Validate})
}
