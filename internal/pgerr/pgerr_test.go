package pgerr_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/internal/pgerr"
)

func TestClassification(t *testing.T) {
	pg := func(code string) error { return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: code}) }
	cases := []struct {
		err               error
		unavailable, data bool
		conflict          string
	}{
		{pg("08006"), true, false, ""},       // connection failure
		{pg("53300"), true, false, ""},       // too many connections
		{pg("57P01"), true, false, ""},       // admin shutdown
		{pg("58030"), true, false, ""},       // io error
		{pg("40001"), false, false, "40001"}, // serialization failure
		{pg("40P01"), false, false, "40P01"}, // deadlock
		{pg("22021"), false, true, ""},       // invalid byte sequence
		{pg("54000"), false, true, ""},       // program limit
		{pg("23505"), false, false, ""},      // unique violation: the handler's business
		{errors.New("dial tcp: refused"), true, false, ""},
		{pgx.ErrTxCommitRollback, false, false, ""},
		{nil, false, false, ""},
	}
	for _, c := range cases {
		if got := pgerr.Unavailable(c.err); got != c.unavailable {
			t.Errorf("Unavailable(%v) = %v", c.err, got)
		}
		if got := pgerr.DataRefused(c.err); got != c.data {
			t.Errorf("DataRefused(%v) = %v", c.err, got)
		}
		if got := pgerr.Conflict(c.err); got != c.conflict {
			t.Errorf("Conflict(%v) = %q", c.err, got)
		}
	}
	if got := pgerr.Conflict(nil, pg("23505"), pg("40P01")); got != "40P01" {
		t.Errorf("Conflict of several = %q", got)
	}
}

// An integrity violation is a refusal of the value, except a duplicate key.
func TestIntegrity(t *testing.T) {
	pg := func(code string) error { return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: code}) }
	for code, want := range map[string]bool{"23503": true, "23514": true, "23502": true, "23505": false, "22021": false, "40001": false} {
		if got := pgerr.Integrity(pg(code)); got != want {
			t.Errorf("Integrity(%s) = %v, want %v", code, got, want)
		}
	}
	if pgerr.Integrity(errors.New("dial tcp: refused")) || pgerr.Integrity(nil) {
		t.Error("Integrity of a non-server error")
	}
}

// A connection the server refused: the database does not exist (3D000), or
// the login was refused (28P01 password, 28000 pg_hba.conf or role).
func TestConnectionRefusals(t *testing.T) {
	pg := func(code string) error { return fmt.Errorf("connect: %w", &pgconn.PgError{Code: code}) }
	for _, c := range []struct {
		err            error
		missing, login bool
	}{
		{pg("3D000"), true, false},
		{pg("28P01"), false, true},
		{pg("28000"), false, true},
		{pg("08006"), false, false},
		{errors.New("dial tcp: refused"), false, false},
		{nil, false, false},
	} {
		if got := pgerr.MissingDatabase(c.err); got != c.missing {
			t.Errorf("MissingDatabase(%v) = %v", c.err, got)
		}
		if got := pgerr.LoginRefused(c.err); got != c.login {
			t.Errorf("LoginRefused(%v) = %v", c.err, got)
		}
	}
}
