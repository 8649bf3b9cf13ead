package relay

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/internal/pause"
)

// listenCheckChannel is the channel of the LISTEN self-test (CheckListen); no
// trigger notifies it.
const listenCheckChannel = "km0_listen_check"

// ErrNoNotification is wrapped by CheckListen's error when the server
// accepted LISTEN and NOTIFY but the notification never came back: the
// session that listened is not the session the client talks to between
// transactions, as behind a transaction-pooling PgBouncer.
var ErrNoNotification = errors.New("relay: LISTEN does not work through this connection: a notification sent through another session never arrived (a transaction- or statement-pooling PgBouncer, or another pooler, between km0 and PostgreSQL)")

// sessionParams are the settings Sessions sends at connection time that a
// pooler may refuse (PgBouncer: "unsupported startup parameter"); the relay
// then sets them in each of its transactions instead.
var sessionParams = []string{"synchronous_commit", "jit"}

// CheckListen is the relay's LISTEN self-test: it connects twice with cfg,
// LISTENs on the channel km0_listen_check in one session, NOTIFYs it with a random
// payload through the other, and waits up to wait for the notification. nil
// when it arrived; an error wrapping ErrNoNotification when it did not; any
// other error when a connection or a statement failed. It sends only simple
// protocol statements, which every pool mode accepts.
func CheckListen(ctx context.Context, cfg *pgx.ConnConfig, wait time.Duration) error {
	tok := make([]byte, 8)
	_, _ = rand.Read(tok)
	payload := hex.EncodeToString(tok)
	listener, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer listener.Close(context.WithoutCancel(ctx))
	if _, err := listener.Exec(ctx, "LISTEN "+listenCheckChannel, pgx.QueryExecModeSimpleProtocol); err != nil {
		return fmt.Errorf("LISTEN: %w", err)
	}
	notifier, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer notifier.Close(context.WithoutCancel(ctx))
	if _, err := notifier.Exec(ctx, "NOTIFY "+listenCheckChannel+", '"+payload+"'", pgx.QueryExecModeSimpleProtocol); err != nil {
		return fmt.Errorf("NOTIFY: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for {
		n, err := listener.WaitForNotification(wctx)
		switch {
		case err == nil && n.Payload == payload:
			return nil
		case err == nil: // another check's notification
		case ctx.Err() != nil:
			return ctx.Err()
		case wctx.Err() != nil:
			return fmt.Errorf("%w (waited %v)", ErrNoNotification, wait)
		default:
			return fmt.Errorf("waiting for the notification: %w", err)
		}
	}
}

// refusedStartupParam reports whether err is a pooler refusing a startup
// parameter (PgBouncer's FATAL "unsupported startup parameter", 08P01).
func refusedStartupParam(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "08P01" && strings.Contains(pe.Message, "unsupported startup parameter")
}

// selfTest decides, once per Relay, how its sessions can work, before any of
// them connects: if the server refuses the session settings at connection,
// they move into each claim transaction (SET LOCAL); if LISTEN does not work
// (CheckListen), the relay polls instead, and since a session is then not
// kept either, the shards are owned per transaction (pooled). It retries
// with backoff while the database cannot be reached, and returns only the
// error of ctx.
func (r *Relay) selfTest(ctx context.Context) error {
	if r.tested {
		return nil
	}
	log := r.cfg.Logger.With("relay", r.q.payload)
	failures := 0
	for {
		err := CheckListen(ctx, r.connCfg, r.cfg.ListenCheckTimeout)
		switch {
		case err == nil:
			r.tested = true
			return nil
		case errors.Is(err, ErrNoNotification):
			r.tested = true
			r.pooled.Store(true)
			r.pollOnly()
			log.Warn("relay: falling back to polling; shards owned per transaction", "cause", err.Error(),
				"poll_interval", r.cfg.PollInterval)
			return nil
		case refusedStartupParam(err) && !r.setLocal:
			r.setLocal = true
			for _, p := range sessionParams {
				delete(r.connCfg.RuntimeParams, p)
			}
			log.Warn("relay: the server refused session settings at connection (a pooler such as PgBouncer); setting them in each transaction",
				"settings", strings.Join(sessionParams, ","))
			continue
		case ctx.Err() != nil:
			return ctx.Err()
		}
		failures++
		d := pause.Backoff(r.cfg.BackoffMin, r.cfg.BackoffMax, failures)
		log.Warn("relay: LISTEN self-test failed; retrying", "err", err, "retry_in", d)
		pause.Sleep(ctx, d)
	}
}

// pollOnly makes the worker sessions of a pooled relay safe behind
// transaction pooling: statements are not kept prepared across
// transactions (the next one may run on another server session), only
// their descriptions.
func (r *Relay) pollOnly() {
	if r.connCfg.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
		r.connCfg.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	}
}

// Pooled reports whether the LISTEN self-test failed, so that the relay
// polls every PollInterval and owns its shards per claim transaction
// (transaction-level advisory locks) instead of per session. false until
// the first Run or RunOnce has run the self-test.
func (r *Relay) Pooled() bool { return r.pooled.Load() }

// claimPooled begins the transaction, locks for it the shards no other
// relay holds (pg_try_advisory_xact_lock, released at COMMIT or ROLLBACK,
// and refused while a session-mode relay holds the shard's session lock)
// and returns them. The claim that follows, in the same transaction, reads
// a snapshot taken after the locks were granted.
func (w *worker) claimPooled(ctx context.Context) ([]int32, error) {
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	w.queueLocal(b)
	all := make([]int32, ShardCount)
	for i := range all {
		all[i] = int32(i)
	}
	b.Queue(w.r.q.acquireXact, all, lockKey(w.r.space, 0))
	br := w.conn.SendBatch(ctx, b)
	defer br.Close()
	for range b.Len() - 1 {
		if _, err := br.Exec(); err != nil {
			return nil, fmt.Errorf("relay: begin: %w", err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("relay: take shards: %w", err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("relay: take shards: %w", err)
	}
	return got, br.Close()
}

// queueLocal queues the session settings the server refused at connection
// as SET LOCAL for the transaction just begun.
func (w *worker) queueLocal(b *pgx.Batch) {
	if w.r.setLocal {
		for _, p := range sessionParams {
			b.Queue("SET LOCAL " + p + " = off")
		}
	}
}
