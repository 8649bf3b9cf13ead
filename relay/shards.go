package relay

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pause"
)

// worker is one claim loop with its own session. The session holds, as
// session advisory locks, the membership lock (shared) and the locks of the
// shards the worker owns; it also runs every claim and mark transaction of
// the worker. If the session dies, PostgreSQL drops the locks and aborts the
// open claim together, so no other worker can take a shard while a claimed,
// unmarked batch of it is alive (docs/design/outbox-relay.md, R2).
type worker struct {
	r        *Relay
	idx      int
	wake     chan struct{}
	activate chan struct{} // an extra worker's start signal (adaptive Workers)

	active       atomic.Bool // an extra worker is running (set by activateExtra)
	rebalanceNow atomic.Bool // rebalance at the next step (another worker left or released shards)
	dormant      bool        // an extra worker waits for activate (its own goroutine's state)
	lastBusy     time.Time   // an extra worker's last claim at least a quarter full

	conn          *pgx.Conn
	batch         int     // size of the next claim
	owned         []int32 // sorted shard numbers whose locks conn holds
	ownedCount    atomic.Int32
	lastRebalance time.Time
}

func (w *worker) poke() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// connect opens the session and joins the members if not connected.
func (w *worker) connect(ctx context.Context) error {
	if w.conn != nil && !w.conn.IsClosed() {
		return nil
	}
	w.drop()
	conn, err := pgx.ConnectConfig(ctx, w.r.connCfg)
	if err != nil {
		return fmt.Errorf("relay: connect: %w", err)
	}
	if w.r.pooled.Load() {
		// No session lock: it would stay on whichever server session ran
		// the statement.
		w.conn = conn
		return nil
	}
	if _, err := conn.Exec(ctx, w.r.q.join, lockKey(w.r.space, memberObjID)); err != nil {
		conn.Close(context.WithoutCancel(ctx))
		return fmt.Errorf("relay: join: %w", err)
	}
	w.conn = conn
	w.lastRebalance = time.Time{}
	// One more member: the others' fair share shrinks, so they release
	// shards for this one now rather than at their next periodic rebalance.
	w.r.rebalanceOthers(w)
	return nil
}

// extra reports whether w is an extra worker of an adaptive instance: it
// runs only while the backlog needs it.
func (w *worker) extra() bool { return w.r.adaptive && w.idx > 0 }

// retire makes an extra worker leave between transactions: it releases its
// shards and its membership at once (not when the server gets round to
// ending the closed session), closes its session, and has the others take
// the shards back.
func (w *worker) retire(ctx context.Context) {
	if w.conn != nil {
		if w.r.pooled.Load() {
			// Nothing held between transactions, and the statement would
			// unlock another client's server session.
		} else if _, err := w.conn.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
			w.r.cfg.Logger.Debug("relay: unlocking before leaving", "relay", w.r.q.payload, "worker", w.idx, "err", err)
		}
		w.drop()
		w.r.rebalanceOthers(w)
		w.r.cfg.Logger.Debug("relay: extra worker left", "relay", w.r.q.payload, "worker", w.idx)
	}
	w.dormant = true
	select { // a start signal left over from an earlier Run
	case <-w.activate:
	default:
	}
	w.active.Store(false)
}

// drop closes the session. PostgreSQL releases its locks and rolls back its
// open transaction, if any.
func (w *worker) drop() {
	if w.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		w.conn.Close(ctx)
		cancel()
		w.conn = nil
	}
	w.setOwned(nil)
}

func (w *worker) setOwned(s []int32) {
	w.owned = s
	if w.r.pooled.Load() {
		w.ownedCount.Store(0) // candidates only: locked per claim transaction
	} else {
		w.ownedCount.Store(int32(len(s)))
	}
	if w.r.m != nil {
		w.r.m.shards.Set(float64(w.r.OwnedShards()))
	}
}

// rebalance makes the worker own its fair share, ceil(64 / members), of the
// shards: it releases extras and tries to lock free ones. It runs only
// between transactions, so a shard is never released with a claim open.
func (w *worker) rebalance(ctx context.Context) error {
	w.lastRebalance = time.Now()
	if w.r.pooled.Load() {
		// Every shard is a candidate; claimPooled locks per transaction
		// those no other relay holds.
		if len(w.owned) != ShardCount {
			all := make([]int32, ShardCount)
			for i := range all {
				all[i] = int32(i)
			}
			w.setOwned(all)
		}
		return nil
	}
	var members int
	var taken []int32
	if err := w.conn.QueryRow(ctx, w.r.q.members, int64(w.r.space), int64(memberObjID)).Scan(&members, &taken); err != nil {
		return fmt.Errorf("relay: count members: %w", err)
	}
	target := (ShardCount + max(members, 1) - 1) / max(members, 1)
	base := lockKey(w.r.space, 0)
	owned := slices.Clone(w.owned)
	switch {
	case len(owned) > target:
		extra := owned[target:]
		if _, err := w.conn.Exec(ctx, w.r.q.release, extra, base); err != nil {
			return fmt.Errorf("relay: release shards: %w", err)
		}
		owned = owned[:target]
		defer w.r.rebalanceOthers(w) // a worker of this instance may be waiting for them
	case len(owned) < target:
		busy := make([]bool, ShardCount)
		for _, s := range taken {
			if s >= 0 && s < ShardCount {
				busy[s] = true
			}
		}
		for _, s := range owned {
			busy[s] = true
		}
		// Start the search at a point of our own so that workers joining
		// together try different shards first.
		start := int(w.r.space>>8+uint32(w.idx)*17+uint32(time.Now().UnixNano()>>10)) % ShardCount
		var want []int32
		for i := 0; i < ShardCount && len(want) < target-len(owned); i++ {
			if s := int32((start + i) % ShardCount); !busy[s] {
				want = append(want, s)
			}
		}
		if len(want) > 0 {
			rows, err := w.conn.Query(ctx, w.r.q.acquire, want, base)
			if err != nil {
				return fmt.Errorf("relay: take shards: %w", err)
			}
			got, err := pgx.CollectRows(rows, pgx.RowTo[int32])
			if err != nil {
				return fmt.Errorf("relay: take shards: %w", err)
			}
			owned = append(owned, got...)
		}
	}
	slices.Sort(owned)
	if !slices.Equal(owned, w.owned) {
		w.r.cfg.Logger.Debug("relay: shards rebalanced", "relay", w.r.q.payload, "worker", w.idx,
			"members", members, "target", target, "owned", len(owned))
	}
	w.setOwned(owned)
	return nil
}

// run is the worker's loop for Relay.Run. It returns nil when ctx is done, or
// the error of a fault-injection hook.
func (w *worker) run(ctx context.Context) error {
	log := w.r.cfg.Logger.With("relay", w.r.q.payload, "worker", w.idx)
	failures := 0
	for ctx.Err() == nil {
		if w.dormant {
			select {
			case <-ctx.Done():
				return nil
			case <-w.activate:
			}
			w.dormant, w.lastBusy = false, time.Now()
			log.Debug("relay: extra worker joins for the backlog")
		}
		res, err := w.step(ctx)
		if err != nil {
			if ce := (*crashError)(nil); asCrash(err, &ce) {
				return ce.err
			}
			if ctx.Err() != nil {
				return nil
			}
			failures++
			w.r.m.failures.Inc()
			d := pause.Backoff(w.r.cfg.BackoffMin, w.r.cfg.BackoffMax, failures)
			log.Warn("relay: cycle failed; rows stay pending", "err", err, "failures", failures, "retry_in", d)
			pause.Sleep(ctx, d)
			continue
		}
		if failures > 0 {
			log.Info("relay: recovered", "after_failures", failures)
			failures = 0
		}
		full := res.claimed > 0 && res.claimed >= res.limit
		if w.r.adaptive && full && (res.limit >= 4*BatchSizeStart || w.r.cfg.BatchSize > 0) {
			w.r.activateExtra(w.batch) // a backlog: overlap another worker
		}
		if w.extra() {
			// Busy while its claims come back at least a quarter full: with
			// the load shared, neither worker's claims need be full, and
			// leaving then would only bring it back once the first worker
			// falls behind again.
			if res.claimed > 0 && res.claimed >= res.limit/4 {
				w.lastBusy = time.Now()
			} else if time.Since(w.lastBusy) >= extraWorkerIdle {
				w.retire(ctx)
				continue
			}
		}
		if full {
			continue // more is waiting: no pause after a full batch
		}
		w.wait(ctx)
	}
	return nil
}

// step connects if needed, rebalances when due and runs one cycle. A
// database error closes the session (it is reopened on the next step).
func (w *worker) step(ctx context.Context) (cycleResult, error) {
	if err := w.connect(ctx); err != nil {
		return cycleResult{}, err
	}
	if w.rebalanceNow.Swap(false) || time.Since(w.lastRebalance) >= w.r.cfg.RebalanceInterval {
		if err := w.rebalance(ctx); err != nil {
			w.drop()
			return cycleResult{}, err
		}
	}
	return w.cycle(ctx)
}

// claimSize is the LIMIT of the worker's next claim: BatchSize if set, else
// the adaptive size.
func (w *worker) claimSize() int {
	if w.r.cfg.BatchSize > 0 {
		return w.r.cfg.BatchSize
	}
	if w.batch == 0 {
		w.batch = BatchSizeStart
	}
	return w.batch
}

// adapt sets the adaptive size after a claim of limit rows returned got.
func (w *worker) adapt(limit, got int) {
	if w.r.cfg.BatchSize == 0 {
		w.batch = nextBatch(limit, got)
	}
}

// nextBatch is the adaptive claim size after a claim of limit rows returned
// got: double after a full claim (there is more waiting), half after one
// under a quarter full, between BatchSizeStart and BatchSizeAdaptiveMax.
func nextBatch(limit, got int) int {
	switch {
	case got >= limit:
		limit *= 2
	case got < limit/4:
		limit /= 2
	}
	return min(max(limit, BatchSizeStart), BatchSizeAdaptiveMax)
}

// wait blocks until a notification, the poll interval or the next rebalance.
func (w *worker) wait(ctx context.Context) {
	d := w.r.cfg.PollInterval
	if next := time.Until(w.lastRebalance.Add(w.r.cfg.RebalanceInterval)); next < d {
		d = max(next, 0)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-w.wake:
	case <-t.C:
	}
}
