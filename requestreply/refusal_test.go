package requestreply_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/requestreply"
)

// A handler's PostgreSQL error reaches the requester without PostgreSQL's
// text, and a refusal of the request's values (SQLSTATE classes 22, 54, 23
// but 23505) is permanent: every retry would fail the same way.
func TestDatabaseErrorsAreRedactedAndDataErrorsArePermanent(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	cases := []struct {
		code      string
		retryable bool
	}{
		{"22021", false}, // invalid byte sequence (a NUL)
		{"54000", false}, // index row size exceeds the btree maximum
		{"23514", false}, // check violation
		{"23505", true},  // unique violation: a concurrent writer, retry
		{"08006", true},  // connection failure
		{"40001", true},  // serialization failure
	}
	for _, c := range cases {
		t.Run(c.code, func(t *testing.T) {
			pgErr := &pgconn.PgError{Severity: "ERROR", Code: c.code, Message: "invalid byte sequence for encoding \"UTF8\": 0x00",
				Detail: "Key (comanda_id)=(P-2026-000951) on host db.intern", Where: "SQL statement \"INSERT INTO autoritzacions\""}
			h := func(context.Context, *requestreply.Request) ([]byte, error) {
				return nil, fmt.Errorf("pagaments: store authorisation: %w", pgErr)
			}
			body, isErr := requestreply.Serve(context.Background(), log, h, &requestreply.Request{ID: "x"})
			_, err := requestreply.DecodeReply("pagaments", requestreply.ResultError, body)
			var re *requestreply.RemoteError
			if !isErr || !errors.As(err, &re) {
				t.Fatalf("want an error reply, got %s", body)
			}
			for _, leak := range []string{"SQLSTATE", c.code, "invalid byte", "comanda_id", "db.intern", "INSERT", "ERROR", "store authorisation"} {
				if strings.Contains(string(body), leak) {
					t.Errorf("reply %s carries %q", body, leak)
				}
			}
			if re.Retryable != c.retryable {
				t.Errorf("reintentable %v, want %v (%s)", re.Retryable, c.retryable, body)
			}
		})
	}
}

// A Conflict error is a distinct, non-retryable error reply that the
// requester recognises with errors.Is(err, ErrConflict); other error replies
// are not conflicts.
func TestConflictIsADistinctNonRetryableReply(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	h := func(context.Context, *requestreply.Request) ([]byte, error) {
		return nil, requestreply.Conflict(errors.New("conflict: order P-2026-000951 already holds another authorisation"))
	}
	body, isErr := requestreply.Serve(context.Background(), log, h, &requestreply.Request{ID: "x"})
	_, err := requestreply.DecodeReply("pagaments", requestreply.ResultError, body)
	var re *requestreply.RemoteError
	if !isErr || !errors.As(err, &re) || re.Retryable || !re.Conflict || !errors.Is(err, requestreply.ErrConflict) ||
		!strings.HasPrefix(re.Message, "conflict: ") {
		t.Fatalf("want a non-retryable conflict reply, got %s (%v)", body, err)
	}
	body, _ = requestreply.Serve(context.Background(), log, func(context.Context, *requestreply.Request) ([]byte, error) {
		return nil, requestreply.BadRequest(errors.New("bad request: x"))
	}, &requestreply.Request{ID: "x"})
	if _, err := requestreply.DecodeReply("pagaments", requestreply.ResultError, body); errors.Is(err, requestreply.ErrConflict) {
		t.Fatalf("a bad request is not a conflict: %v", err)
	}
}

// CheckID refuses, before any SQL, ids PostgreSQL would refuse or choke on.
func TestCheckIDRefusesUnstorableIDs(t *testing.T) {
	t.Parallel()
	for _, id := range []string{"", "P-2026-\x00", "P-\xff", "P-2026-\n1", strings.Repeat("P", 8<<10)} {
		err := requestreply.CheckID("comanda_id", id, 0)
		if err == nil || !strings.Contains(err.Error(), "comanda_id") {
			t.Errorf("CheckID(%.20q) = %v, want a bad request naming comanda_id", id, err)
		}
	}
	if err := requestreply.CheckID("comanda_id", "P-2026-000951", 0); err != nil {
		t.Fatal(err)
	}
}
