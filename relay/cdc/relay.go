// Package cdc is the change-data-capture relay of the transactional outbox:
// it reads the outbox's inserts from PostgreSQL's write-ahead log (logical
// replication, the pgoutput plugin, a publication of the table's inserts and
// a named slot) and publishes each row with the same records, keys, headers
// and guarantees as the polling relay (package relay), without querying the
// table for work.
//
// Order per aggregate (CONTRACT.md guarantee 5): logical decoding emits
// transactions in commit order, and the relay publishes them in that order
// (a batch goes to the broker beside the one in flight only when no
// aggregate is in both), so every aggregate's events go out in commit order
// with any number of concurrent writers, without shards or locks.
//
// At-least-once (guarantees 4 and 7): a batch's rows are marked published
// (publicat_en) only after the broker confirmed every record, and the
// position of a transaction is confirmed to the server (standby status
// update) only after its rows are marked. A crash anywhere in between makes
// the server send the transaction again, and the relay republishes it with
// the same id_esdeveniment.
//
// In WAL mode (Config.WAL) it publishes instead the outbox's logical
// decoding messages (outbox.ModeWAL): the same records, with no table to
// mark; the slot's confirmed position, moved only after the broker
// confirmed every event up to it, is the record of what is published.
//
// docs/design/cdc.md states the invariants and where they are enforced.
package cdc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/pause"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/internal/relaycore"
)

// Relay streams outbox inserts to the broker. Create it with New.
type Relay struct {
	cfg        Config
	connCfg    *pgx.ConnConfig // ordinary sessions: lock, catch-up, marks
	replCfg    *pgconn.Config  // the replication session
	stats      *pgxpool.Pool   // metrics and pruning
	ownPool    bool
	enc        *relaycore.Encoder
	q          queries
	lockKey    int64
	m          *metrics
	lag        lagTracker
	running    atomic.Bool
	warnedKeep atomic.Bool
	faults     faults.CDC // of the current Run (internal/faults), set before its goroutines start
	prefix     string     // WAL mode: the messages' prefix (migrate.WALPrefix)
	legacySlot string     // a defaulted table-mode Slot: DefaultSlot, refused to be left behind
}

// New checks cfg and returns a Relay. It opens no connection yet. The error
// wraps ErrConfig for an invalid cfg.
func New(cfg Config) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r := &Relay{cfg: cfg, q: newQueries(cfg.Names, cfg.DeletePublished, cfg.WAL), lockKey: relaycore.MemberLockKey(cfg.Names), enc: newEncoder(cfg.Config)}
	// Its own pool, when it opens one, has 2 connections. A lost mark only
	// republishes rows with the same ids (docs/design/cdc.md).
	var err error
	if r.stats, r.ownPool, r.connCfg, err = relaycore.Sessions(relaycore.DB{Pool: cfg.Pool, DatabaseURL: cfg.DatabaseURL, ApplicationName: cfg.ApplicationName}, 2, ErrConfig); err != nil {
		if errors.Is(err, ErrConfig) {
			return nil, err
		}
		return nil, fmt.Errorf("cdc: %w", err)
	}
	database := cmp.Or(r.connCfg.Database, r.connCfg.User) // PostgreSQL's default database is the user's name
	switch {
	case cfg.Slot != "":
	case cfg.WAL:
		r.cfg.Slot = migrate.WALSlot(database, cfg.Names)
	default:
		r.cfg.Slot, r.legacySlot = DefaultSlotIn(database, cfg.Names), DefaultSlot(cfg.Names)
	}
	if cfg.WAL && cfg.Publication == "" {
		r.cfg.Publication = r.cfg.Slot
	}
	r.prefix = migrate.WALPrefix(cfg.Names)
	// Custom plans for every statement: the marks' id = ANY($n) filters
	// are then hashed instead of searched one element at a time (1,000
	// comparisons a row for a batch of 1,000 under the generic plan that
	// prepared statements switch to after five runs).
	r.connCfg.RuntimeParams["plan_cache_mode"] = "force_custom_plan"
	r.replCfg = r.connCfg.Config.Copy()
	delete(r.replCfg.RuntimeParams, "plan_cache_mode")
	r.replCfg.RuntimeParams["replication"] = "database"
	// The decoder reads creat_en in the ISO format.
	r.replCfg.RuntimeParams["DateStyle"] = "ISO"
	r.replCfg.RuntimeParams["TimeZone"] = "UTC"
	if r.m, err = newMetrics(r); err != nil {
		r.Close()
		return nil, fmt.Errorf("cdc: metrics: %w", err)
	}
	return r, nil
}

// Close closes the pool the relay opened from DatabaseURL. Do not call it
// during Run.
func (r *Relay) Close() {
	if r.ownPool {
		r.stats.Close()
	}
}

// Slot and Publication return the names the relay uses.
func (r *Relay) Slot() string        { return r.cfg.Slot }
func (r *Relay) Publication() string { return r.cfg.Publication }

// Active reports whether this instance holds the slot now.
func (r *Relay) Active() bool { return r.m.activeNow.Load() }

// crashError carries a hook's error out: the relay stops.
type crashError struct{ err error }

func (e *crashError) Error() string { return e.err.Error() }
func (e *crashError) Unwrap() error { return e.err }

// Run relays until ctx is done and returns nil. It returns at once an error
// wrapping ErrSetup when the server cannot serve CDC (wal_level, privilege,
// publication, slot), relay.ErrRunning during another Run, and the error of
// a crash point (internal/faults). Everything else (database, broker or network
// failures; another instance holding the slot) is logged and retried: an
// instance that does not hold the slot waits for it and takes over as soon
// as the holder's sessions end.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return relay.ErrRunning
	}
	defer r.running.Store(false)
	r.faults = faults.CDCFrom(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	pctx, stopPrune := context.WithCancel(ctx)
	defer stopPrune()
	if r.cfg.PruneOlderThan > 0 {
		wg.Go(func() { r.prune(pctx) })
	}
	log := r.cfg.Logger.With("relay", r.q.payload, "slot", r.cfg.Slot)
	failures := 0
	for ctx.Err() == nil {
		streamed, err := r.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		var crash *crashError
		switch {
		case errors.As(err, &crash):
			return crash.err
		case errors.Is(err, ErrSetup):
			return err
		}
		if streamed {
			failures = 0
		}
		failures++
		r.m.failures.Inc()
		d := pause.Backoff(r.cfg.BackoffMin, r.cfg.BackoffMax, failures)
		log.Warn("cdc: session ended; retrying", "err", err, "retry_in", d)
		pause.Sleep(ctx, d)
	}
	return nil
}

// session is one term of the relay: it waits for the outbox's exclusive
// relay lock, makes sure of the publication and the slot, acquires the
// slot, publishes what is pending outside the stream (the catch-up), then
// streams until a failure or ctx's end. streamed reports that it reached
// the stream.
func (r *Relay) session(parent context.Context) (streamed bool, err error) {
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	log := r.cfg.Logger.With("relay", r.q.payload, "slot", r.cfg.Slot)
	lock, err := pgx.ConnectConfig(ctx, r.connCfg)
	if err != nil {
		return false, fmt.Errorf("cdc: connect: %w", err)
	}
	defer closeConn(lock)
	if err := r.check(ctx, lock); err != nil {
		return false, err
	}
	// One active instance per outbox: the lock excludes the other CDC
	// instances and the polling relay's workers (which hold it shared).
	var got bool
	if err := lock.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", r.lockKey).Scan(&got); err != nil {
		return false, fmt.Errorf("cdc: lock: %w", err)
	}
	if !got {
		log.Info("cdc: another relay of this outbox is active; waiting to take over")
		if _, err := lock.Exec(ctx, "SELECT pg_advisory_lock($1)", r.lockKey); err != nil {
			return false, fmt.Errorf("cdc: lock: %w", err)
		}
	}
	exists, resume, err := r.slotState(ctx, lock)
	if err != nil {
		return false, err
	}
	if r.cfg.WAL {
		err = r.ensureWALPublication(ctx, lock, exists)
	} else {
		err = r.ensurePublication(ctx, lock)
	}
	if err != nil {
		return false, err
	}
	blocked, err := r.parkedAggregates(ctx, lock)
	if err != nil {
		return false, err
	}
	markConn, err := pgx.ConnectConfig(ctx, r.connCfg)
	if err != nil {
		return false, fmt.Errorf("cdc: connect: %w", err)
	}
	defer closeConn(markConn)
	repl, err := pgconn.ConnectConfig(ctx, r.replCfg)
	if err != nil {
		return false, fmt.Errorf("cdc: replication connection: %w", err)
	}
	defer closeConn(repl)

	p := newPipeline(r, blocked, newMarker(r, markConn))
	var catchUp pgx.Tx
	var start pglogrepl.LSN
	exact := false // the catch-up reads the slot's own snapshot
	snapshot := "EXPORT_SNAPSHOT"
	if r.cfg.WAL {
		// Nothing to catch up with: no message was written before the slot
		// (outbox.ErrNoSlot), and none of before is kept anyway.
		snapshot = "NOEXPORT_SNAPSHOT"
	}
	if !exists && r.cfg.WAL {
		log.Warn("cdc: the WAL-mode outbox had no slot; creating it now (create it with km0 migrate --outbox-mode wal " +
			"before the writers start: until it exists they are refused)")
	}
	var snapName string
	if !exists {
		res, err := pglogrepl.CreateReplicationSlot(ctx, repl, r.cfg.Slot, "pgoutput",
			pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: snapshot})
		if err != nil {
			return false, fmt.Errorf("cdc: create slot %s: %w", r.cfg.Slot, err)
		}
		if start, err = pglogrepl.ParseLSN(res.ConsistentPoint); err != nil {
			return false, fmt.Errorf("cdc: slot %s: consistent point %q: %w", r.cfg.Slot, res.ConsistentPoint, err)
		}
		log.Info("cdc: slot created", "consistent_point", start.String())
		snapName = res.SnapshotName
	}
	if !exists && !r.cfg.WAL {
		// Import the slot's snapshot before the replication session runs
		// another command: pending rows are exactly the rows committed before
		// the consistent point, the stream exactly those after it.
		if catchUp, err = lock.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}); err != nil {
			return false, fmt.Errorf("cdc: catch-up: %w", err)
		}
		if _, err := catchUp.Exec(ctx, "SET TRANSACTION SNAPSHOT "+quoteLiteral(snapName)); err != nil {
			return false, fmt.Errorf("cdc: catch-up: import the slot's snapshot: %w", err)
		}
		exact = true
	}
	if err := r.startReplication(ctx, repl, start); err != nil {
		return false, err
	}
	r.m.active(true)
	defer r.m.active(false)
	defer r.lag.reset() // a new session receives the unconfirmed transactions again
	if exists {
		start = resume // what the server resumes from (START_REPLICATION at 0/0 means there)
	}
	log.Info("cdc: holding the slot", "start", start.String(), "mode", r.mode())

	rd := newReader(r, repl, p.marker, start)
	var readerErr error
	readerExit := make(chan struct{})
	rctx, stopReader := context.WithCancel(ctx)
	go func() {
		readerErr = rd.run(rctx)
		close(readerExit)
	}()
	var mwg sync.WaitGroup
	mctx, stopMarker := context.WithCancel(context.WithoutCancel(ctx))
	mwg.Go(func() { p.marker.run(mctx) })
	crashed := false
	defer func() {
		stopReader()
		<-readerExit
		if !crashed && parent.Err() != nil {
			// A graceful stop: mark what the broker confirmed and tell the
			// server, so that a restart republishes as little as possible.
			fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = p.flush(fctx)
			cancel()
			p.marker.drain(5 * time.Second)
			stopMarker()
			mwg.Wait()
			rd.finalStatus()
		}
		stopMarker()
		mwg.Wait()
	}()
	if !r.cfg.WAL {
		if err := p.catchUp(ctx, lock, catchUp, exact, nil); err != nil {
			crashed = isCrash(err)
			return false, err
		}
	}
	if h := r.faults.Streaming; h != nil {
		h()
	}
	err = p.stream(ctx, rd.out, readerExit, func() error { return readerErr }, lock)
	crashed = isCrash(err)
	return true, err
}

// mode is the outbox mode the relay reads, for the logs.
func (r *Relay) mode() string {
	if r.cfg.WAL {
		return "wal"
	}
	return "table"
}

// closeConn closes a session, waiting at most a second for a clean goodbye.
func closeConn(c interface{ Close(context.Context) error }) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = c.Close(ctx)
}

func isCrash(err error) bool {
	var c *crashError
	return errors.As(err, &c)
}

// startReplication acquires the slot and starts the stream. A slot still
// held by a session that is going away (the previous holder was killed and
// the server has not noticed yet) is retried every 100 ms.
func (r *Relay) startReplication(ctx context.Context, repl *pgconn.PgConn, start pglogrepl.LSN) error {
	args := []string{"proto_version '1'", "publication_names " + quoteLiteral(pgx.Identifier{r.cfg.Publication}.Sanitize())}
	if r.cfg.WAL {
		args = append(args, "messages 'true'")
	}
	for {
		err := pglogrepl.StartReplication(ctx, repl, r.cfg.Slot, start, pglogrepl.StartReplicationOptions{
			Mode: pglogrepl.LogicalReplication, PluginArgs: args})
		var pgErr *pgconn.PgError
		if err == nil {
			return nil
		}
		if !errors.As(err, &pgErr) || pgErr.Code != "55006" { // object_in_use: active for another PID
			return fmt.Errorf("cdc: start replication on slot %s: %w", r.cfg.Slot, err)
		}
		r.cfg.Logger.Debug("cdc: slot still held by a session that is ending; retrying", "slot", r.cfg.Slot)
		pause.Sleep(ctx, 100*time.Millisecond)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

func (r *Relay) prune(ctx context.Context) {
	log := r.cfg.Logger.With("relay", r.q.payload)
	t := time.NewTicker(r.cfg.PruneInterval)
	defer t.Stop()
	for {
		n, err := relay.Prune(ctx, r.stats, r.cfg.Names, r.cfg.PruneOlderThan, r.cfg.PruneBatch)
		if err != nil && ctx.Err() == nil {
			log.Warn("cdc: prune failed; retrying at the next pass", "err", err)
		}
		r.m.pruned.Add(float64(n))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// quoteLiteral is s as an SQL string literal.
func quoteLiteral(s string) string {
	out := make([]byte, 0, len(s)+2)
	out = append(out, '\'')
	for i := 0; i < len(s); i++ {
		if s[i] == '\'' {
			out = append(out, '\'')
		}
		if s[i] != 0 {
			out = append(out, s[i])
		}
	}
	return string(append(out, '\''))
}

// newEncoder returns the record encoder of the polling relay's cfg (with
// its defaults): the CDC relay publishes the same records.
func newEncoder(cfg relay.Config) *relaycore.Encoder {
	cfg = cfg.WithDefaults()
	return relaycore.NewEncoder(relaycore.EncoderConfig{Topic: cfg.Topic, Origin: cfg.Origin, Transform: cfg.Transform,
		MaxRecordBytes: cfg.MaxRecordBytes, Publisher: cfg.Publisher})
}
