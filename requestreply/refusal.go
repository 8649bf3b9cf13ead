package requestreply

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/outcome"
)

// ErrConflict is matched (errors.Is) by a Conflict error and by the
// *RemoteError of its reply: the server already holds a different request
// under the same key (an order id authorised for another amount, say). The
// server neither answers with the other request's decision nor records this
// one; retrying cannot help.
var ErrConflict = errors.New("requestreply: conflict with a stored request")

type conflictError struct{ err error }

func (e *conflictError) Error() string        { return e.err.Error() }
func (e *conflictError) Unwrap() error        { return e.err }
func (e *conflictError) Is(target error) bool { return target == ErrConflict }

// Conflict marks err as a conflict: Serve answers it with a non-retryable
// error reply flagged "conflicte": true, which the requester sees as a
// *RemoteError with Conflict set (errors.Is(err, ErrConflict)). Start err's
// text with "conflict: ".
func Conflict(err error) error { return outcome.Permanent(&conflictError{err: err}) }

// MaxIDBytesDefault is the longest id CheckID accepts by default: far below
// what a PostgreSQL btree key holds (about 2,700 bytes).
const MaxIDBytesDefault = 200

// CheckID returns a BadRequest error naming field unless id is storable as a
// key: not empty, at most max bytes (MaxIDBytesDefault when max <= 0), valid
// UTF-8, without NUL or other control characters. Servers call it before any
// SQL, so that a bad id is a clear, permanent refusal and never a database
// error.
func CheckID(field, id string, max int) error {
	if max <= 0 {
		max = MaxIDBytesDefault
	}
	switch {
	case id == "":
		return BadRequest(fmt.Errorf("bad request: %s: required", field))
	case len(id) > max:
		return BadRequest(fmt.Errorf("bad request: %s: %d bytes, the maximum is %d", field, len(id), max))
	case !utf8.ValidString(id):
		return BadRequest(fmt.Errorf("bad request: %s: invalid UTF-8", field))
	case strings.IndexFunc(id, unicode.IsControl) >= 0:
		return BadRequest(fmt.Errorf("bad request: %s: contains control characters (NUL included)", field))
	}
	return nil
}

// Texts of the error replies that stand for a PostgreSQL error.
const (
	msgDataRefused = "bad request: the database refuses a value of the request (invalid, too long or outside the constraints)"
	msgDBFailed    = "internal error: the database failed; try again"
)

// redact replaces an error that carries a PostgreSQL error by one without
// PostgreSQL's text (statement, values, host): the remote requester gets the
// class of failure, the log gets the whole error. A data exception (SQLSTATE
// class 22), a program limit such as an over-long key (54) and an integrity
// violation other than a unique one (23, not 23505) are refusals of this
// request's values, so they are permanent; any other PostgreSQL error keeps
// its class (retryable unless the handler marked it permanent).
func redact(log *slog.Logger, req *Request, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	log.Warn("requestreply: handler failed on the database; the requester gets no database text",
		"id_peticio", clipID(req.ID), "sqlstate", pgErr.Code, "err", err)
	if pgerr.DataRefused(err) || pgerr.Integrity(err) {
		return BadRequest(errors.New(msgDataRefused))
	}
	if kind, _ := outcome.Classify(err, nil); kind == outcome.KindPermanent {
		return BadRequest(errors.New(msgDataRefused))
	}
	return errors.New(msgDBFailed)
}
