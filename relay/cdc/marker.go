package cdc

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/km0/km0/internal/pause"
)

// job is one published batch: the rows to mark, the rows to park, and the
// position to confirm once both are committed (0: none, a catch-up batch).
type job struct {
	ids      []pgtype.UUID
	tids     []pgtype.TID // the ctids of ids (catch-up batches), or nil
	parkIDs  []uuid.UUID
	parkAggs []string
	parkWhy  []string
	end      pglogrepl.LSN
	commit   time.Time
	barrier  chan struct{} // closed once every earlier job is committed
	// WAL mode: the messages to keep in the parking table (parked ones
	// with their motiu, those waiting behind them with nil), and, for a
	// batch read back from it (fromParked), the ids the broker confirmed,
	// to delete from it.
	wal        walRows
	fromParked bool
	walDone    []uuid.UUID
}

// markMergeMax bounds the rows of one marking round trip when the marker
// has fallen behind and merges queued jobs.
const markMergeMax = 20_000

// markChunk is the most rows of one marking UPDATE (a round trip holds
// several). Up to a few thousand, PostgreSQL finds them by ctid or through
// the primary key; given arrays of 20,000 it scans the whole table (about
// 22 µs a row instead of 5, measured on a 200,000-row outbox).
const markChunk = 1000

// markQueue is how many confirmed batches may wait for their marks before
// the pipeline waits: a slow UPDATE does not stall the stream, and a crash
// republishes a bounded number of rows.
const markQueue = 16

// marker commits the marks and parkings of published batches, in order, on
// its own session, while the pipeline publishes the next batch; then it
// makes the batch's position the confirmed one.
type marker struct {
	r         *Relay
	conn      *pgx.Conn
	jobs      chan job
	confirmed atomic.Uint64 // the position the reader may report as flushed
	dead      chan struct{} // closed when the marker failed; err says why
	err       error
	once      sync.Once
}

func newMarker(r *Relay, conn *pgx.Conn) *marker {
	return &marker{r: r, conn: conn, jobs: make(chan job, markQueue), dead: make(chan struct{})}
}

func (m *marker) fail(err error) {
	m.once.Do(func() {
		m.err = err
		close(m.dead)
	})
}

// add queues j; it waits while markQueue jobs are queued already.
func (m *marker) add(ctx context.Context, j job) error {
	select {
	case m.jobs <- j:
		return nil
	case <-m.dead:
		return m.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// wait returns once every job added before it is committed.
func (m *marker) wait(ctx context.Context) error {
	b := make(chan struct{})
	if err := m.add(ctx, job{barrier: b}); err != nil {
		return err
	}
	select {
	case <-b:
		return nil
	case <-m.dead:
		return m.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// drain is wait with a timeout of its own, for a graceful stop.
func (m *marker) drain(d time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	_ = m.wait(ctx)
}

func (m *marker) run(ctx context.Context) {
	for {
		var first job
		select {
		case <-ctx.Done():
			m.fail(ctx.Err())
			return
		case first = <-m.jobs:
		}
		batch := []job{first}
		n := len(first.ids)
	merge:
		for first.barrier == nil && n < markMergeMax {
			select {
			case j := <-m.jobs:
				batch = append(batch, j)
				n += len(j.ids)
				if j.barrier != nil {
					break merge
				}
			default:
				break merge
			}
		}
		if err := m.commit(ctx, batch); err != nil {
			m.fail(err)
			return
		}
		for _, j := range batch {
			if j.barrier != nil {
				close(j.barrier)
			}
		}
	}
}

// commit marks and parks the rows of batch in one implicit transaction (one
// round trip), then confirms the batch's last position.
func (m *marker) commit(ctx context.Context, batch []job) error {
	var ids, byTID []pgtype.UUID // every id; those of byTID's rows
	var tids []pgtype.TID
	var parkIDs []uuid.UUID
	var parkAggs, parkWhy []string
	var end pglogrepl.LSN
	var wal walRows
	var walDone []uuid.UUID
	for _, j := range batch {
		wal.append(&j.wal)
		walDone = append(walDone, j.walDone...)
		ids = append(ids, j.ids...)
		parkIDs, parkAggs, parkWhy = append(parkIDs, j.parkIDs...), append(parkAggs, j.parkAggs...), append(parkWhy, j.parkWhy...)
		end = max(end, j.end)
	}
	var byID []pgtype.UUID
	for _, j := range batch {
		if m.r.cfg.WAL { // nothing to mark: the slot's position is the mark
			break
		}
		if j.tids != nil {
			tids, byTID = append(tids, j.tids...), append(byTID, j.ids...)
		} else {
			byID = append(byID, j.ids...)
		}
	}
	if len(ids) > 0 || len(parkIDs) > 0 || len(wal.ids) > 0 || len(walDone) > 0 {
		b := &pgx.Batch{}
		marks := 0
		// In statements of at most markChunk rows: given arrays of many
		// thousand ctids or ids (merged jobs), the planner scans the table.
		for i := 0; i < len(byTID); i += markChunk {
			j := min(i+markChunk, len(byTID))
			b.Queue(m.r.q.markTID, tids[i:j], byTID[i:j])
			marks++
		}
		for c := range slices.Chunk(byID, markChunk) {
			b.Queue(m.r.q.mark, c)
			marks++
		}
		if len(parkIDs) > 0 {
			b.Queue(m.r.q.park, parkIDs, parkAggs, parkWhy)
		}
		if len(wal.ids) > 0 {
			wal.queue(b, m.r.q.wal.store)
		}
		if len(walDone) > 0 {
			b.Queue(m.r.q.wal.done, walDone)
		}
		br := m.conn.SendBatch(ctx, b)
		var marked int64
		for range marks {
			tag, err := br.Exec()
			if err != nil {
				_ = br.Close()
				return fmt.Errorf("cdc: mark %d rows: %w", len(ids), err)
			}
			marked += tag.RowsAffected()
		}
		if err := br.Close(); err != nil {
			return fmt.Errorf("cdc: mark %d rows, park %d: %w", len(ids), len(parkIDs), err)
		}
		if marked < int64(len(ids)) && !m.r.cfg.WAL {
			if err := m.markLate(ctx, ids, marked); err != nil {
				return err
			}
		}
		if h := m.r.faults.AfterMark; h != nil {
			if err := h(len(ids)); err != nil {
				return &crashError{err}
			}
		}
		m.r.m.published.Add(float64(len(ids)))
		m.r.m.parked.Add(float64(len(parkIDs) + wal.parkedCount()))
	}
	if end > 0 {
		for {
			old := m.confirmed.Load()
			if uint64(end) <= old || m.confirmed.CompareAndSwap(old, uint64(end)) {
				break
			}
		}
		m.r.lag.confirmed(end)
	}
	return nil
}

// lagTracker knows the commit time of every transaction the pipeline took
// from the stream and the marker has not confirmed yet.
type lagTracker struct {
	mu    sync.Mutex
	queue []lagEntry
}

type lagEntry struct {
	end    pglogrepl.LSN
	commit time.Time
}

func (l *lagTracker) received(end pglogrepl.LSN, commit time.Time) {
	l.mu.Lock()
	l.queue = append(l.queue, lagEntry{end, commit})
	l.mu.Unlock()
}

func (l *lagTracker) confirmed(end pglogrepl.LSN) {
	l.mu.Lock()
	i := 0
	for i < len(l.queue) && l.queue[i].end <= end {
		i++
	}
	l.queue = append(l.queue[:0], l.queue[i:]...)
	l.mu.Unlock()
}

func (l *lagTracker) reset() {
	l.mu.Lock()
	l.queue = l.queue[:0]
	l.mu.Unlock()
}

// seconds is the age of the oldest unconfirmed transaction, 0 when none.
func (l *lagTracker) seconds(now time.Time) float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.queue) == 0 {
		return 0
	}
	return max(0, now.Sub(l.queue[0].commit).Seconds())
}

// lateMarkWait bounds how long the marker waits for rows of a batch to
// become visible.
const lateMarkWait = 5 * time.Second

// markLate marks the rows of ids the first statements did not find (they
// marked done). The server sends a transaction as soon as its commit record
// is written, which can be a moment before the transaction is visible to
// other sessions: its rows are not found yet. A row already marked (a
// republished one) is found and left alone. The marker counts the visible
// rows before each UPDATE, so that the UPDATE (a later snapshot) sees at
// least those, and stops when all are. With DeletePublished the rows it
// deleted are gone from the count and are counted as found.
func (m *marker) markLate(ctx context.Context, ids []pgtype.UUID, done int64) error {
	var gone int64 // rows of ids deleted (DeletePublished)
	if m.r.cfg.DeletePublished {
		gone = done
	}
	end := time.Now().Add(lateMarkWait)
	for {
		var visible int64
		if err := m.conn.QueryRow(ctx, m.r.q.visible, ids).Scan(&visible); err != nil {
			return fmt.Errorf("cdc: mark: %w", err)
		}
		found := visible + gone
		for c := range slices.Chunk(ids, markChunk) {
			tag, err := m.conn.Exec(ctx, m.r.q.mark, c)
			if err != nil {
				return fmt.Errorf("cdc: mark: %w", err)
			}
			if m.r.cfg.DeletePublished {
				gone += tag.RowsAffected()
			}
		}
		if found >= int64(len(ids)) {
			return nil
		}
		if time.Now().After(end) {
			m.r.cfg.Logger.Warn("cdc: published rows not found to mark (deleted meanwhile?)", "relay", m.r.q.payload,
				"rows", int64(len(ids))-found)
			return nil
		}
		pause.Sleep(ctx, time.Millisecond) // the writer's transaction is becoming visible
	}
}
