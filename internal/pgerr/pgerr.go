// Package pgerr classifies PostgreSQL errors for km0's retry decisions, in
// one place: the database is unavailable (retry the same work in place, it
// is not the work's fault), the transaction lost a race (rerun it), or the
// database refused a value as data (the same value fails every time).
package pgerr

import (
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// SQLSTATEs of a transaction that lost a race with another one and may
// simply run again.
const (
	SerializationFailure = "40001"
	DeadlockDetected     = "40P01"
)

// Unavailable reports whether err says the database, not the transaction's
// content, is the problem: a network or connect error (anything that is not
// a server error), or a server error of class 08 (connection), 53
// (insufficient resources), 57 (operator intervention: shutdown, terminated
// backend) or 58 (system). A COMMIT that turned into a rollback
// (pgx.ErrTxCommitRollback) is about the transaction: not unavailable.
func Unavailable(err error) bool {
	if err == nil || errors.Is(err, pgx.ErrTxCommitRollback) {
		return false
	}
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		return true
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return true
	}
	switch class(pe.Code) {
	case "08", "53", "57", "58":
		return true
	}
	return false
}

// Conflict returns the SQLSTATE of the first of errs that is a deadlock
// (40P01) or a serialisation failure (40001), or "".
func Conflict(errs ...error) string {
	for _, err := range errs {
		var pe *pgconn.PgError
		if errors.As(err, &pe) && (pe.Code == SerializationFailure || pe.Code == DeadlockDetected) {
			return pe.Code
		}
	}
	return ""
}

// DataRefused reports whether PostgreSQL refused a value itself: a data
// exception (class 22: a NUL byte, invalid UTF-8, out of range) or a program
// limit (class 54: a key too long for its index). The same value fails on
// every try.
func DataRefused(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (class(pe.Code) == "22" || class(pe.Code) == "54")
}

// Integrity reports an integrity constraint violation (class 23) other than
// a unique violation (23505): a foreign key, a check or a not-null refused
// the value. A unique violation is left out: it usually means the work was
// already done (a duplicate), which the caller decides.
func Integrity(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && class(pe.Code) == "23" && pe.Code != UniqueViolation
}

// UniqueViolation is the SQLSTATE of a duplicate key.
const UniqueViolation = "23505"

// DataException reports a server error of class 22 only.
func DataException(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && class(pe.Code) == "22"
}

// Server reports whether err carries a server error (any SQLSTATE).
func Server(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe)
}

func class(code string) string {
	if len(code) < 2 {
		return code
	}
	return strings.ToUpper(code[:2])
}

// SQLSTATEs of a connection the server refused for who asked or what for.
const (
	InvalidCatalogName   = "3D000" // the database does not exist
	InvalidPassword      = "28P01"
	InvalidAuthorization = "28000" // pg_hba.conf has no entry, or the role may not log in
)

// MissingDatabase reports whether the server said the database of the
// connection does not exist (3D000).
func MissingDatabase(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == InvalidCatalogName
}

// LoginRefused reports whether the server refused the login: a wrong
// password (28P01) or no pg_hba.conf entry or login right (28000).
func LoginRefused(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == InvalidPassword || pe.Code == InvalidAuthorization)
}
