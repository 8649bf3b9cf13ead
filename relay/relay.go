// Package relay publishes committed outbox rows to the broker: claim, publish,
// wait for every confirmation, then mark, in one transaction (at-least-once,
// CONTRACT.md guarantees 4 and 7).
//
// Order per aggregate (guarantee 5) holds with concurrent writers and several
// relay instances: rows are split into ShardCount shards by agregat_id, and a
// shard is served by one worker at a time, the one holding its session
// advisory lock on the very connection that claims and marks. Within a shard
// rows go out in creat_en order, which the outbox trigger makes equal to commit
// order per aggregate. docs/design/outbox-relay.md states the invariants and
// the code that enforces them.
//
// The relay wakes on LISTEN km0_outbox at once and polls as a fallback. A
// self-test at start (CheckListen) finds a connection on which LISTEN does
// not work, as through a transaction-pooling PgBouncer: the relay then
// polls only, and owns shards per claim transaction instead of per session
// (docs/deploying.md, PgBouncer). It
// reconnects by itself after the database or the broker went away, backing
// off exponentially. Rows the broker refuses for good are parked in
// <outbox>_aparcats, and their aggregate waits behind them until an operator
// releases them (Release, `km0 outbox release`).
package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/pause"
	"github.com/km0/km0/relay/internal/relaycore"
)

// probes returns the crash points and test probes ctx carries (package
// internal/faults; none outside km0's own tests and chaos run).
func probes(ctx context.Context) faults.Relay {
	if h := faults.RelayFrom(ctx); h != nil {
		return *h
	}
	return faults.Relay{}
}

// ErrRunning is returned by Run or RunOnce while another Run or RunOnce is
// active on the same Relay.
var ErrRunning = errors.New("relay: already running")

// Relay moves outbox rows to the broker. Create it with New.
type Relay struct {
	cfg      Config
	connCfg  *pgx.ConnConfig
	stats    *pgxpool.Pool
	ownPool  bool
	q        queries
	enc      *relaycore.Encoder
	space    uint32
	m        *metrics
	workers  []*worker
	adaptive bool        // Workers 0: workers after the first join under a backlog
	running  atomic.Bool // set while Run or RunOnce runs
	// Set by selfTest before any worker connects (pooler.go).
	tested   bool        // the self-test ran
	setLocal bool        // the server refused sessionParams at connection: SET LOCAL them
	pooled   atomic.Bool // LISTEN does not work: poll, own shards per transaction
	mu       sync.Mutex  // serialises RunOnce and Close
}

// New checks cfg and returns a Relay. It opens no connection yet. The error
// wraps ErrConfig for an invalid cfg.
func New(cfg Config) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r := &Relay{cfg: cfg, q: newQueries(cfg.Names, cfg.DeletePublished), enc: newEncoder(cfg), space: lockSpace(cfg.Names)}
	var err error
	if r.stats, r.ownPool, r.connCfg, err = relaycore.Sessions(relaycore.DB{Pool: cfg.Pool, DatabaseURL: cfg.DatabaseURL, ApplicationName: cfg.ApplicationName}, 1, ErrConfig); err != nil {
		if errors.Is(err, ErrConfig) {
			return nil, err
		}
		return nil, fmt.Errorf("relay: %w", err)
	}
	if r.m, err = newMetrics(r); err != nil {
		r.closePool()
		return nil, fmt.Errorf("relay: metrics: %w", err)
	}
	n := cfg.Workers
	if n == 0 {
		n, r.adaptive = WorkersDefault, true
	}
	for i := range n {
		r.workers = append(r.workers, &worker{r: r, idx: i, wake: make(chan struct{}, 1), activate: make(chan struct{}, 1),
			dormant: r.adaptive && i > 0})
	}
	return r, nil
}

// Run relays until ctx is done, then closes its sessions (releasing its
// shards) and returns nil. Failures of the broker or the database are logged,
// counted and retried with backoff; Run returns early only with the error of a
// crash point (internal/faults) or ErrRunning.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return ErrRunning
	}
	defer r.running.Store(false)
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if r.selfTest(ctx) != nil {
		return nil // ctx is done
	}
	var wg sync.WaitGroup
	if !r.pooled.Load() {
		wg.Go(func() { r.listen(ctx) })
	}
	if r.cfg.PruneOlderThan > 0 {
		wg.Go(func() { r.prune(ctx) })
	}
	r.join(ctx)
	for _, w := range r.workers {
		wg.Go(func() {
			if err := w.run(ctx); err != nil {
				cancel(err)
			}
		})
	}
	wg.Wait()
	r.closeWorkers()
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

// join connects the workers that run from the start (all of them, or only
// the first when adaptive) and then rebalances them one after the other, so
// that from the start each counts all of this instance's workers and they
// split the free shards among them instead of racing for the same ones (a
// shard lost in such a race waits for the next rebalance). An extra worker
// left connected by RunOnce leaves first. A failure is left to the worker's
// loop, which retries.
func (r *Relay) join(ctx context.Context) {
	var starting []*worker
	for _, w := range r.workers {
		if w.extra() {
			w.retire(ctx)
			continue
		}
		starting = append(starting, w)
	}
	for _, w := range starting {
		if w.connect(ctx) != nil {
			return
		}
	}
	for _, w := range starting {
		if w.rebalance(ctx) != nil {
			w.drop()
			return
		}
	}
}

// activateExtra starts the first dormant extra worker, if any: it connects,
// joins the members, and takes its share of the shards from the others. Its
// first claim is of size batch, the activating worker's (the backlog is
// there already).
func (r *Relay) activateExtra(batch int) {
	if r.pooled.Load() {
		return // each worker tries every shard in each claim: one is enough
	}
	for _, w := range r.workers {
		if w.extra() && w.active.CompareAndSwap(false, true) {
			w.batch = batch // read by w's goroutine after it receives the signal
			w.activate <- struct{}{}
			return
		}
	}
}

// rebalanceOthers makes this instance's other workers rebalance at their next
// step: w released shards, or left.
func (r *Relay) rebalanceOthers(w *worker) {
	for _, o := range r.workers {
		if o != w {
			o.rebalanceNow.Store(true)
			o.poke()
		}
	}
}

// RunOnce connects the workers if needed, rebalances shards and runs one
// claim-publish-mark cycle per worker. It returns how many rows it marked
// published. Sessions stay open (and shards owned) until Close. An error
// leaves the failed worker's rows pending; the next call retries them.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	if !r.running.CompareAndSwap(false, true) {
		return 0, ErrRunning
	}
	defer r.running.Store(false)
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.selfTest(ctx); err != nil {
		return 0, err
	}
	for _, w := range r.workers {
		if err := w.connect(ctx); err != nil {
			return 0, err
		}
	}
	total := 0
	for _, w := range r.workers {
		if err := w.rebalance(ctx); err != nil {
			w.drop()
			return total, err
		}
		res, err := w.cycle(ctx)
		total += res.published
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// Close closes the relay's sessions (releasing its shards) and, when the
// relay opened it from DatabaseURL, its pool. Do not call it during Run.
func (r *Relay) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closeWorkers()
	r.closePool()
}

func (r *Relay) closeWorkers() {
	for _, w := range r.workers {
		w.drop()
	}
}

func (r *Relay) closePool() {
	if r.ownPool {
		r.stats.Close()
	}
}

// Lag is the relay lag.
type Lag struct {
	Pending int64         // rows with publicat_en IS NULL, parked ones included
	Oldest  time.Duration // age of the oldest of them; 0 when none
}

// Lag measures the pending rows and the age of the oldest one.
func (r *Relay) Lag(ctx context.Context) (Lag, error) {
	var l Lag
	var secs float64
	if err := r.stats.QueryRow(ctx, r.q.lag).Scan(&l.Pending, &secs); err != nil {
		return Lag{}, fmt.Errorf("relay: lag: %w", err)
	}
	l.Oldest = time.Duration(secs * float64(time.Second))
	return l, nil
}

// OwnedShards returns how many shards this instance's workers own now
// between transactions: 0 when Pooled (each claim transaction locks its
// shards for itself only).
func (r *Relay) OwnedShards() int {
	n := 0
	for _, w := range r.workers {
		n += int(w.ownedCount.Load())
	}
	return n
}

func (r *Relay) wakeAll() {
	for _, w := range r.workers {
		w.poke()
	}
}

// listen keeps a LISTEN session and wakes the workers on every notification
// for this table. After (re)connecting it wakes them too: notifications sent
// while it was away are lost, and the rows may be waiting.
func (r *Relay) listen(ctx context.Context) {
	log := r.cfg.Logger.With("relay", r.q.payload, "session", "listen")
	failures := 0
	for ctx.Err() == nil {
		err := r.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		failures++
		d := pause.Backoff(r.cfg.BackoffMin, r.cfg.BackoffMax, failures)
		log.Warn("relay: LISTEN session lost; reconnecting", "err", err, "retry_in", d)
		pause.Sleep(ctx, d)
	}
}

func (r *Relay) listenOnce(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.connCfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{notifyChannel}.Sanitize()); err != nil {
		return err
	}
	r.wakeAll()
	if h := probes(ctx).Listening; h != nil {
		h()
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload == r.q.payload {
			r.wakeAll()
		}
	}
}

// newEncoder returns the record encoder of cfg (with its defaults), the one
// the CDC relay builds too (relaycore.NewEncoder).
func newEncoder(cfg Config) *relaycore.Encoder {
	return relaycore.NewEncoder(relaycore.EncoderConfig{Topic: cfg.Topic, Origin: cfg.Origin, Transform: cfg.Transform,
		MaxRecordBytes: cfg.MaxRecordBytes, Publisher: cfg.Publisher})
}
