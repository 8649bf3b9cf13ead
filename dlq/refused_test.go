package dlq

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
)

// Only PostgreSQL refusing a row for what it holds sets a letter aside; an
// outage, a missing table or a duplicate is retried with the whole batch.
func TestOnlyARefusedRowIsSetAside(t *testing.T) {
	t.Parallel()
	pg := func(code string) error { return fmt.Errorf("dlq: index x: %w", &pgconn.PgError{Code: code}) }
	for err, want := range map[error]bool{
		pg("22003"): true,  // numeric value out of range
		pg("22021"): true,  // invalid byte sequence
		pg("54000"): true,  // index row size exceeds the btree maximum
		pg("23514"): true,  // check violation
		pg("23502"): true,  // not-null violation
		pg("23505"): false, // unique violation: ON CONFLICT's business
		pg("42P01"): false, // undefined table: the schema, not the letter
		pg("08006"): false, // connection failure
		pg("57P01"): false, // admin shutdown
		errors.New("dial tcp 127.0.0.1:5432: connect: connection refused"): false,
	} {
		if got := rowRefused(err); got != want {
			t.Errorf("rowRefused(%v) = %v, want %v", err, got, want)
		}
	}
}

// bound clamps and cuts in place; headers stay whole.
func TestBoundFitsTheColumns(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é", MaxIndexedText) // 2 bytes a rune: the cut falls inside one
	l := &Letter{Attempts: math.MaxInt, OriginalPartition: -7, OriginalOffset: -9, Reason: long, OriginalTopic: "a\x00\xffb"}
	l.bound()
	if l.Attempts != math.MaxInt32 || l.OriginalPartition != -1 || l.OriginalOffset != -1 {
		t.Fatalf("numbers: %d %d %d", l.Attempts, l.OriginalPartition, l.OriginalOffset)
	}
	if len(l.Reason) != MaxIndexedText || !utf8.ValidString(l.Reason) {
		t.Fatalf("motiu cut to %d bytes, valid UTF-8 %v", len(l.Reason), utf8.ValidString(l.Reason))
	}
	if l.OriginalTopic != "a\uFFFD\uFFFDb" {
		t.Fatalf("topic_original %q", l.OriginalTopic)
	}
	l = &Letter{Attempts: -5}
	if l.bound(); l.Attempts != 0 {
		t.Fatalf("intents -5 bounded to %d", l.Attempts)
	}
}
