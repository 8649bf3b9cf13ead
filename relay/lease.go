package relay

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pause"
)

// The notify lease (migrate's 006_avis_en_repos.sql, docs/design/outbox-relay.md
// R-lease). NOTIFY takes a server-wide lock at commit until the commit is
// durable, so writers that notify commit one at a time. While notifications
// arrive often and this instance alone serves every shard, the relay holds a
// lease in <schema>.km0_avisos and claims every leasePoll by itself; writers
// that insert while it runs do not notify.
const (
	// leaseFor is how long one lease runs (server time); it is renewed
	// while claims find rows.
	leaseFor = 100 * time.Millisecond
	// leasePoll is the claim interval while a lease runs.
	leasePoll = time.Millisecond
	// leaseRetry is the pause after the lease table could not be written
	// (not migrated, no privilege): writers keep notifying meanwhile.
	leaseRetry = time.Minute
	// leaseWaitMax caps the interval between looks at the transactions
	// that may have skipped their NOTIFY, once the lease has ended.
	leaseWaitMax = 20 * time.Millisecond
)

// leaseState is what the workers and the LISTEN session tell the lease loop.
type leaseState struct {
	notified chan struct{} // a notification for this table (buffered 1)
	lastNote atomic.Int64  // unix ns of the previous notification
	often    atomic.Bool   // two notifications less than leaseFor apart
	lastRows atomic.Int64  // unix ns of the last claim that found rows
}

// noteNotification is called by the LISTEN session for each notification
// of this table.
func (r *Relay) noteNotification() {
	now := time.Now().UnixNano()
	if prev := r.lease.lastNote.Swap(now); now-prev < int64(leaseFor) {
		r.lease.often.Store(true)
	}
	select {
	case r.lease.notified <- struct{}{}:
	default:
	}
}

// noteRows is called by a worker whose claim found rows.
func (r *Relay) noteRows() { r.lease.lastRows.Store(time.Now().UnixNano()) }

// leaseLoop takes a lease when notifications come often and this instance
// owns every shard, holds it while claims find rows, and then ends it
// without losing a wake-up (endLease). Errors end the lease (writers notify
// again once it has run out) and are retried later.
func (r *Relay) leaseLoop(ctx context.Context) {
	log := r.cfg.Logger.With("relay", r.q.payload, "session", "lease")
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.WithoutCancel(ctx))
		}
	}()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
			return
		case <-r.lease.notified:
		}
		if !r.lease.often.Swap(false) || r.OwnedShards() != ShardCount {
			continue // another instance serves some shards: their writers must notify
		}
		if conn == nil || conn.IsClosed() {
			c, err := pgx.ConnectConfig(ctx, r.connCfg)
			if err != nil {
				log.Debug("relay: notify lease: connect failed; writers keep notifying", "err", err)
				pause.Sleep(ctx, r.cfg.BackoffMax)
				continue
			}
			conn = c
		}
		if err := r.holdLease(ctx, conn); err != nil && ctx.Err() == nil {
			log.Debug("relay: notify lease failed; writers notify once it has run out", "err", err)
			conn.Close(context.WithoutCancel(ctx))
			conn = nil
			r.wakeAll()
			pause.Sleep(ctx, leaseRetry)
		}
	}
}

// holdLease takes the lease, claims every leasePoll (waking the workers)
// and renews it while claims find rows and this instance owns every shard,
// then ends it (endLease).
func (r *Relay) holdLease(ctx context.Context, conn *pgx.Conn) error {
	take := func() error {
		_, err := conn.Exec(ctx, r.q.leaseTake, r.q.leaseKey, leaseFor.Microseconds())
		return err
	}
	if err := take(); err != nil {
		return err
	}
	renewed := time.Now()
	r.noteRows() // the notifications that brought the lease had rows
	tick := time.NewTicker(leasePoll)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			// Stopping: end the lease now, so that writers notify the
			// next relay (best effort; it runs out by itself anyway).
			c, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			_, _ = conn.Exec(c, r.q.leaseTake, r.q.leaseKey, 0)
			cancel()
			return nil
		case <-tick.C:
		}
		r.wakeAll()
		if time.Since(renewed) < leaseFor/2 {
			continue
		}
		if time.Since(time.Unix(0, r.lease.lastRows.Load())) >= leaseFor || r.OwnedShards() != ShardCount {
			return r.endLease(ctx, conn)
		}
		if err := take(); err != nil {
			return err
		}
		renewed = time.Now()
	}
}

// endLease makes sure no commit waits for the fallback poll once the lease
// has run out. A writer that skipped its NOTIFY read the lease after taking
// its lock on the outbox table (the trigger runs after its INSERT), so once
// the server's clock is past the lease's end, every such writer has
// committed (a claim from now on sees its rows) or still holds that lock:
// endLease reads the transactions holding one, and wakes the workers each
// time some of them have ended, until none is left. Writers that insert
// from then on notify.
func (r *Relay) endLease(ctx context.Context, conn *pgx.Conn) error {
	for {
		var over bool
		if err := conn.QueryRow(ctx, r.q.leaseOver, r.q.leaseKey).Scan(&over); err != nil {
			return err
		}
		if over {
			break
		}
		r.wakeAll()
		pause.Sleep(ctx, leasePoll)
	}
	// Read after the lease ran out (a statement of its own, so the lock
	// table is read after that clock).
	var vxids []string
	if err := conn.QueryRow(ctx, r.q.leaseHolders, r.q.name).Scan(&vxids); err != nil {
		return err
	}
	wake := func() error {
		r.wakeAll()
		if r.OwnedShards() == ShardCount {
			return nil
		}
		// Another instance serves some shards now (a rebalance during
		// the lease): wake it too.
		_, err := conn.Exec(ctx, "SELECT pg_notify($1, $2)", NotifyChannel, r.q.payload)
		return err
	}
	if err := wake(); err != nil {
		return err
	}
	wait := leasePoll
	for len(vxids) > 0 && ctx.Err() == nil {
		pause.Sleep(ctx, wait)
		var left []string
		if err := conn.QueryRow(ctx, r.q.leaseLeft, vxids).Scan(&left); err != nil {
			return err
		}
		if len(left) < len(vxids) {
			if err := wake(); err != nil { // some ended: their rows, if any, are visible now
				return err
			}
			wait = leasePoll
		} else {
			wait = min(2*wait, leaseWaitMax)
		}
		vxids = left
	}
	return nil
}
