package requestreply_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/requestreply"
)

// A request id PostgreSQL cannot store as a key (a NUL byte, invalid UTF-8,
// too long for the primary key's index) fails the same way on every retry:
// the error reply must say it is a bad request, not invite the requester to
// retry (R5), and the effect must not run.
func TestIdempotentRequestIDThatCannotBeAKeyIsABadRequest(t *testing.T) {
	t.Parallel()
	db := pgtest.NewSchema(t)
	ctx := context.Background()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox, requestreply.Migrations); err != nil {
		t.Fatal(err)
	}
	effects := 0
	h := requestreply.Idempotent(db.Pool, db.Names(), "pagaments.autoritzacio", func(context.Context, pgx.Tx, *requestreply.Request) ([]byte, error) {
		effects++
		return []byte(`{}`), nil
	})
	log := slog.New(slog.DiscardHandler)
	random := make([]byte, 4500)
	_, _ = rand.Read(random)
	long := hex.EncodeToString(random) // 9,000 bytes that do not compress
	for _, id := range []string{"autoritzacio-\x00-1", "autoritzacio-\xff-1", long} {
		body, isErr := requestreply.Serve(ctx, log, h, &requestreply.Request{ID: id, Body: []byte(`{}`)})
		_, err := requestreply.DecodeReply("pagaments", requestreply.ResultError, body)
		var re *requestreply.RemoteError
		if !isErr || !errors.As(err, &re) || re.Retryable || !strings.HasPrefix(re.Message, "bad request") {
			t.Errorf("id %.20q: got %s (error reply %v), want a non-retryable bad request", id, body, isErr)
		}
	}
	if effects != 0 {
		t.Fatalf("%d effects, want 0", effects)
	}
}

// Keys and stored responses are purged separately (inbox.Purge,
// PurgeResponses). A request whose key is gone but whose old response is still
// stored is a new request: the effect runs and the new response replaces the
// old one, instead of every attempt failing on the response's primary key.
func TestIdempotentRequestWhoseKeyWasPurgedBeforeItsResponseRunsAgain(t *testing.T) {
	t.Parallel()
	db := pgtest.NewSchema(t)
	ctx := context.Background()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox, requestreply.Migrations); err != nil {
		t.Fatal(err)
	}
	effects := 0
	h := requestreply.Idempotent(db.Pool, db.Names(), "inventari.reserva", func(context.Context, pgx.Tx, *requestreply.Request) ([]byte, error) {
		effects++
		return []byte(`{"nova":true}`), nil
	})
	if _, err := db.Pool.Exec(ctx, `INSERT INTO respostes_desades (id_peticio, consumidor, resposta, desada_en)
		VALUES ('reserva-1', 'inventari.reserva', '{"vella":true}', now() - interval '15 days')`); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	for range 2 {
		body, isErr := requestreply.Serve(ctx, log, h, &requestreply.Request{ID: "reserva-1", Body: []byte(`{}`)})
		if isErr || string(body) != `{"nova":true}` {
			t.Fatalf("got %s (error reply %v), want the new response", body, isErr)
		}
	}
	if effects != 1 {
		t.Fatalf("%d effects, want 1", effects)
	}
}

// PurgeResponses deletes the stored responses older than the age and keeps
// the younger ones; an age that is not positive is refused and deletes
// nothing (it would take the response of every request still retrying).
func TestPurgeResponsesDeletesOnlyOldResponses(t *testing.T) {
	t.Parallel()
	db := pgtest.NewSchema(t)
	ctx := context.Background()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox, requestreply.Migrations); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO respostes_desades (id_peticio, consumidor, resposta, desada_en) VALUES
		('vella-1', 'inventari.reserva', '{}', now() - interval '15 days'),
		('vella-2', 'inventari.reserva', '{}', now() - interval '20 days'),
		('nova-1', 'inventari.reserva', '{}', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	left := func() (n int) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM respostes_desades`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, age := range []time.Duration{0, -time.Hour} {
		if n, err := requestreply.PurgeResponses(ctx, db.Pool, db.Names(), age); err == nil || n != 0 {
			t.Fatalf("PurgeResponses(age %v) = %d, %v; want 0 and an error", age, n, err)
		}
	}
	if n := left(); n != 3 {
		t.Fatalf("%d responses after the refused purges, want 3", n)
	}
	n, err := requestreply.PurgeResponses(ctx, db.Pool, db.Names(), 14*24*time.Hour)
	if err != nil || n != 2 {
		t.Fatalf("PurgeResponses(14 days) = %d, %v; want 2 deleted", n, err)
	}
	if n := left(); n != 1 {
		t.Fatalf("%d responses left, want 1 (nova-1)", n)
	}
}
