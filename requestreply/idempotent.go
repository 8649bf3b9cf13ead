package requestreply

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/migrate"
)

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations is the migration set of this package: the table
// respostes_desades(id_peticio, consumidor, resposta, desada_en) in the
// schema of migrate.Names. Apply it with migrate.Up together with
// migrate.Inbox.
var Migrations = migrate.Set{Name: "requestreply", FS: sqlFS, Dir: "sql"}

// responsesTable is the table name of stored responses.
const responsesTable = "respostes_desades"

// TxHandler answers one request inside tx, the transaction in which
// Idempotent also records the request id and stores the response.
type TxHandler func(ctx context.Context, tx pgx.Tx, req *Request) ([]byte, error)

// ErrNoRequestID is the error reply of an Idempotent server to a request
// without id (it would have nothing to be idempotent on).
var ErrNoRequestID = errors.New("bad request: no request id (message_id / id_peticio)")

// ErrResponseNotStored means the request id is recorded as processed for this
// consumer but no response was stored (the key was written by something
// else, or the stored response was purged).
var ErrResponseNotStored = errors.New("requestreply: request already processed; its response is not stored")

// Idempotent returns a Handler that runs h at most once per request id for
// consumer. In one transaction on db it records (req.ID, consumer) in
// missatges_processats (package inbox, names from names), runs h and stores
// h's response in respostes_desades; if the key was already recorded it
// returns the stored response instead, without running h. A concurrent
// repeat waits for the first transaction and then reads its response. If h
// fails, nothing persists, the error is the reply, and a repeat runs h again.
// A request without id is a bad request (ErrNoRequestID), and so is one
// whose id PostgreSQL refuses as a key (NUL byte, invalid UTF-8, too long).
func Idempotent(db inbox.Beginner, names migrate.Names, consumer string, h TxHandler) Handler {
	names = names.WithDefaults()
	in := inbox.New(inbox.Config{Names: names})
	table := pgx.Identifier{names.Schema, responsesTable}.Sanitize()
	// A stored response without its key (the key was purged first) belongs to
	// a request that is over: the new one replaces it.
	insert := "INSERT INTO " + table + " (id_peticio, consumidor, resposta) VALUES ($1, $2, $3)" +
		" ON CONFLICT (id_peticio, consumidor) DO UPDATE SET resposta = EXCLUDED.resposta, desada_en = now()"
	sel := "SELECT resposta FROM " + table + " WHERE id_peticio = $1 AND consumidor = $2"
	return func(ctx context.Context, req *Request) ([]byte, error) {
		if req.ID == "" {
			return nil, BadRequest(ErrNoRequestID)
		}
		tx, err := db.Begin(ctx)
		if err != nil {
			return nil, fmt.Errorf("requestreply: begin: %w", err)
		}
		defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
		var resp []byte
		ran := false
		res, err := in.ProcessTx(ctx, tx, consumer, req.ID, func(tx pgx.Tx) error {
			ran = true
			var err error
			if resp, err = h(ctx, tx, req); err != nil {
				return err
			}
			if resp == nil {
				resp = []byte{}
			}
			_, err = tx.Exec(ctx, insert, req.ID, consumer, resp)
			return err
		})
		if err != nil {
			if !ran && keyRefused(err) {
				// Every retry would fail the same way: not retryable.
				return nil, BadRequest(fmt.Errorf("bad request: the request id cannot be stored as a key: %w", err))
			}
			return nil, err
		}
		if res == inbox.Duplicate {
			if err := tx.QueryRow(ctx, sel, req.ID, consumer).Scan(&resp); err != nil {
				if errors.Is(err, pgx.ErrNoRows) {
					return nil, fmt.Errorf("%w (id %s)", ErrResponseNotStored, req.ID)
				}
				return nil, fmt.Errorf("requestreply: read stored response: %w", err)
			}
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, fmt.Errorf("requestreply: commit: %w", err)
		}
		return resp, nil
	}
}

// keyRefused reports whether PostgreSQL refused the request id itself: a data
// exception (class 22: a NUL byte, invalid UTF-8) or a program limit (class 54:
// too long for the key's index).
func keyRefused(err error) bool {
	return pgerr.DataRefused(err)
}

// PurgeResponses deletes stored responses older than age (use the inbox
// retention, inbox.RetentionDefault: past it no retry can arrive) and returns
// how many it deleted. Whoever serves with Idempotent runs it periodically,
// beside inbox.Purge, or respostes_desades grows without bound. An age that
// is not positive is refused and deletes nothing: it would take the stored
// response of every request still inside its retry window.
func PurgeResponses(ctx context.Context, db inbox.Beginner, names migrate.Names, age time.Duration) (int64, error) {
	if age <= 0 {
		return 0, fmt.Errorf("requestreply: purge: age %v must be positive", age)
	}
	names = names.WithDefaults()
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	tag, err := tx.Exec(ctx, "DELETE FROM "+pgx.Identifier{names.Schema, responsesTable}.Sanitize()+
		" WHERE desada_en < now() - $1::interval", fmt.Sprintf("%d microseconds", age.Microseconds()))
	if err != nil {
		return 0, fmt.Errorf("requestreply: purge: %w", err)
	}
	return tag.RowsAffected(), tx.Commit(ctx)
}
