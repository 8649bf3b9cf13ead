package relay_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport"
)

// claims records the Claimed hook's calls.
type claims struct {
	mu     sync.Mutex
	limits []int
	rows   []int
	worker map[int]int // rows claimed per worker
}

func (c *claims) hook(worker, limit, rows int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.limits = append(c.limits, limit)
	c.rows = append(c.rows, rows)
	if c.worker == nil {
		c.worker = map[int]int{}
	}
	c.worker[worker] += rows
}

func (c *claims) take() (limits, rows []int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	limits, rows = c.limits, c.rows
	c.limits, c.rows = nil, nil
	return limits, rows
}

// enqueueRounds commits rounds transactions, each with one event for each of
// aggs aggregates, numbered from first (the aggregate's commit order).
func (b *bundle) enqueueRounds(t *testing.T, aggs, first, rounds int) {
	t.Helper()
	ctx := context.Background()
	for r := range rounds {
		evs := make([]*outbox.Event, aggs)
		for a := range evs {
			evs[a] = &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-%03d", a), Type: "comanda.creada",
				Payload: relaytest.SeqPayload{Seq: first + r}}
		}
		if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.EnqueueBatch(ctx, tx, evs) }); err != nil {
			t.Fatal(err)
		}
	}
}

// The adaptive claim size (BatchSize 0) follows the backlog: it doubles from
// BatchSizeStart while claims come back full, stops at BatchSizeAdaptiveMax,
// halves back to BatchSizeStart once claims come back short, and grows
// again for a new backlog. Every row goes out once, in commit order.
func TestAdaptiveClaimSizeFollowsTheBacklog(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var c claims
	cfg := b.config()
	var probe faults.Relay
	probe.Claimed = c.hook
	r := b.newRelay(t, cfg)
	withProbes(r, probe)
	const aggs = 100

	// A backlog of 3,900 rows: 100 + 200 + 400 + 800 + 1,600 full claims,
	// then 800 rows in a claim of 2,000 (max), which keeps the size.
	b.enqueueRounds(t, aggs, 1, 39)
	if n := b.drainOnce(t, r); n != 3900 {
		t.Fatalf("published %d, want 3900", n)
	}
	limits, rows := c.take()
	if want := []int{100, 200, 400, 800, 1600, 2000}; !slices.Equal(limits, want) {
		t.Fatalf("claim sizes under a backlog %v, want %v (rows %v)", limits, want, rows)
	}
	if want := []int{100, 200, 400, 800, 1600, 800}; !slices.Equal(rows, want) {
		t.Fatalf("rows per claim %v, want %v", rows, want)
	}

	// Idle: drainOnce's last, empty claim halved the size to 1,000; claims
	// of a few rows halve it down to BatchSizeStart, where it stays.
	for i := range 6 {
		b.enqueue(t, "P-000", relaytest.SeqPayload{Seq: 40 + i})
		if n, err := r.RunOnce(ctxFor(r)); err != nil || n != 1 {
			t.Fatalf("trickle %d: published %d, %v; want 1", i, n, err)
		}
	}
	limits, _ = c.take()
	if want := []int{1000, 500, 250, 125, relay.BatchSizeStart, relay.BatchSizeStart}; !slices.Equal(limits, want) {
		t.Fatalf("claim sizes when idle %v, want %v", limits, want)
	}

	// A new backlog grows it again.
	b.enqueueRounds(t, aggs, 46, 5) // 500 rows
	if n := b.drainOnce(t, r); n != 500 {
		t.Fatalf("published %d, want 500", n)
	}
	limits, _ = c.take()
	if want := []int{100, 200, 400}; !slices.Equal(limits, want) {
		t.Fatalf("claim sizes for a new backlog %v, want %v", limits, want)
	}

	n := 3900 + 6 + 500
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, n))
	if len(copies) != n {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), n)
	}
	// P-000 got every round and the trickle (1..50); the others skipped
	// the trickle's numbers 40..45.
	if len(perKey) != aggs {
		t.Fatalf("%d keys on the topic, want %d", len(perKey), aggs)
	}
	for a := range aggs {
		key, exp := fmt.Sprintf("P-%03d", a), append(seq(1, 39), seq(46, 50)...)
		if a == 0 {
			exp = seq(1, 50)
		}
		if got := perKey[key]; !slices.Equal(got, exp) {
			t.Fatalf("aggregate %s: got %v, want %v", key, relaytest.ClipInts(got), relaytest.ClipInts(exp))
		}
	}
}

func seq(from, to int) []int {
	var s []int
	for i := from; i <= to; i++ {
		s = append(s, i)
	}
	return s
}

// The relay's defaults (adaptive claims, WorkersDefault workers overlapping
// their claims and publications) keep every aggregate's events in commit
// order with 8 concurrent writers on 200 aggregates: a backlog first, so the
// claims grow, then writers that go on while the relay drains.
func TestDefaultsKeepCommitOrderWithEightWriters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 200)
	var c claims
	cfg := b.config()
	cfg.Workers, cfg.BatchSize = 0, 0 // the defaults
	var probe faults.Relay
	probe.Claimed = c.hook
	r := b.newRelay(t, cfg)
	withProbes(r, probe)
	ctx := context.Background()
	if err := w.Run(ctx, 8, 150, 1); err != nil {
		t.Fatal(err)
	}
	start(t, r)
	if err := w.Run(ctx, 8, 150, 2); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "every row published", func() bool { return b.pending(t) == 0 })
	want := w.Counts(t)
	n := relaytest.Total(want)
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, n))
	if len(copies) != n {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), n)
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.worker) != relay.WorkersDefault || slices.Max(c.limits) <= relay.BatchSizeStart {
		t.Fatalf("claims per worker %v, largest claim %d: want %d workers and claims grown past %d",
			c.worker, slices.Max(c.limits), relay.WorkersDefault, relay.BatchSizeStart)
	}
	t.Logf("%d events on %d aggregates in commit order; rows per worker %v, largest claim %d",
		n, len(want), c.worker, slices.Max(c.limits))
}

// confirming wraps a publisher and records the event ids of every Publish
// call that returned nil: the records the broker confirmed. Once armed, it
// holds the next call until its context ends.
type confirming struct {
	transport.Publisher
	mu        sync.Mutex
	confirmed map[string]bool
	armed     bool
	held      int
}

func (p *confirming) Publish(ctx context.Context, msgs []*transport.Message) error {
	p.mu.Lock()
	hold := p.armed
	if hold {
		p.armed = false
		p.held++
	}
	p.mu.Unlock()
	if hold {
		<-ctx.Done()
		return ctx.Err()
	}
	if err := p.Publisher.Publish(ctx, msgs); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		env, err := envelope.Decode(m.Value)
		if err != nil {
			return err
		}
		p.confirmed[env.ID] = true
	}
	return nil
}

// With adaptive workers, once the second worker has joined for the backlog,
// one worker's batch is on its way to the broker (held by the publisher, so
// never confirmed) when the other worker "dies" after the broker confirmed
// its own batch and before its mark (the AfterPublish crash point of internal/faults). No row is marked
// whose records were not confirmed; the rows left pending are republished
// with the same ids by the next relay, and every aggregate's first
// occurrences stay in commit order.
func TestCrashOfOneWorkerMarksNoUnconfirmedRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const aggs, rounds = 100, 40
	b.enqueueRounds(t, aggs, 1, rounds)
	pub := &confirming{Publisher: b.pub, confirmed: map[string]bool{}}
	cfg := b.config()
	cfg.Workers, cfg.BatchSize = 0, 200 // adaptive workers; batches small enough that both have many
	cfg.Publisher = pub
	var c claims
	armed := false
	var probe faults.Relay
	probe.Claimed = func(worker, limit, rows int) {
		c.hook(worker, limit, rows)
		c.mu.Lock()
		both := len(c.worker) == relay.WorkersDefault
		c.mu.Unlock()
		pub.mu.Lock()
		defer pub.mu.Unlock()
		if both && !armed {
			armed, pub.armed = true, true
		}
	}
	var mu sync.Mutex
	batches, crashed := 0, false
	probe.AfterPublish = func(int) error {
		pub.mu.Lock()
		held := pub.held
		pub.mu.Unlock()
		mu.Lock()
		defer mu.Unlock()
		batches++
		if held > 0 && batches > 3 {
			crashed = true
		}
		if crashed {
			return faults.ErrCrashed
		}
		return nil
	}
	r := b.newRelay(t, cfg)
	withProbes(r, probe)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctxFor(r)) }()
	select {
	case err := <-done:
		if !errors.Is(err, faults.ErrCrashed) {
			t.Fatalf("Run returned %v, want the crash", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return the crash")
	}
	r.Close()

	ids, err := b.s.Pool.Query(context.Background(), "SELECT id::text FROM outbox WHERE publicat_en IS NOT NULL")
	if err != nil {
		t.Fatal(err)
	}
	marked, err := pgx.CollectRows(ids, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	pub.mu.Lock()
	for _, id := range marked {
		if !pub.confirmed[id] {
			t.Errorf("row %s is marked published but its record was never confirmed", id)
		}
	}
	pub.mu.Unlock()
	pending := b.pending(t)
	if len(marked) < 3*200 || pending == 0 || pending+len(marked) != aggs*rounds {
		t.Fatalf("after the crash %d marked and %d pending, want the 3 first batches marked, some pending and %d in all",
			len(marked), pending, aggs*rounds)
	}

	if n := b.drainOnce(t, b.newRelay(t, b.config())); n != pending {
		t.Fatalf("the next relay published %d, want the %d left pending", n, pending)
	}
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, aggs*rounds))
	if len(copies) != aggs*rounds {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), aggs*rounds)
	}
	want := map[string]int{}
	for a := range aggs {
		want[fmt.Sprintf("P-%03d", a)] = rounds
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	t.Logf("%d marked before the crash, %d republished; %d ids published twice", len(marked), pending, countAbove(copies, 1))
}

func countAbove(m map[string]int, n int) int {
	c := 0
	for _, v := range m {
		if v > n {
			c++
		}
	}
	return c
}

// The workers of one instance (a fixed Workers) split the shards between them
// as soon as they start, without waiting for a rebalance: with
// RebalanceInterval 1 h, each of the sessions holds 64 / Workers shard locks.
func TestWorkersSplitTheShardsAtStart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.config()
	cfg.Workers = relay.WorkersDefault // fixed: all of them from the start
	cfg.RebalanceInterval = time.Hour
	r := b.newRelay(t, cfg)
	start(t, r)
	perSession := func() []int {
		rows, err := b.s.Pool.Query(context.Background(), `SELECT count(*) FILTER (WHERE l.objid::bigint < $2)::int
			FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
			WHERE a.application_name = $1 GROUP BY a.pid ORDER BY 1`, cfg.ApplicationName, relay.ShardCount)
		if err != nil {
			t.Fatal(err)
		}
		n, err := pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 20*time.Second, "the relay to own every shard", func() bool { return r.OwnedShards() == relay.ShardCount })
	share := relay.ShardCount / relay.WorkersDefault
	if got := perSession(); len(got) != relay.WorkersDefault || got[0] != share || got[len(got)-1] != share {
		t.Fatalf("shard locks per worker session %v, want %d sessions with %d each", got, relay.WorkersDefault, share)
	}
}

// shardLocks returns, per session of the relay (application_name app), how
// many shard locks it holds, ascending.
func (b *bundle) shardLocks(t *testing.T, app string) []int {
	t.Helper()
	rows, err := b.s.Pool.Query(context.Background(), `SELECT count(l.pid) FILTER (WHERE l.objid::bigint < $2)::int
		FROM pg_stat_activity a LEFT JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
		WHERE a.application_name = $1 GROUP BY a.pid ORDER BY 1`, app, relay.ShardCount)
	if err != nil {
		t.Fatal(err)
	}
	n, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// With the defaults one worker serves every shard; a backlog brings in the
// second worker, which takes half of them from the first at once (periodic
// rebalancing is off: RebalanceInterval 1 h); once idle for ExtraWorkerIdle
// it leaves and the first worker takes its shards back at once, so events of
// every aggregate committed afterwards still go out. All in commit order.
func TestExtraWorkerJoinsForABacklogAndLeavesWhenIdle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var c claims
	cfg := b.config()
	cfg.Workers, cfg.BatchSize = 0, 0
	cfg.RebalanceInterval = time.Hour
	var probe faults.Relay
	probe.Claimed = c.hook
	r := b.newRelay(t, cfg)
	withProbes(r, probe)
	const aggs, rounds = 50, 100
	b.enqueueRounds(t, aggs, 1, rounds)
	start(t, r)
	testkit.Eventually(t, 30*time.Second, "the backlog published", func() bool { return b.pending(t) == 0 })
	c.mu.Lock()
	perWorker := maps.Clone(c.worker)
	c.mu.Unlock()
	if len(perWorker) != relay.WorkersDefault || perWorker[1] == 0 {
		t.Fatalf("rows claimed per worker %v: the extra worker did not join for the backlog", perWorker)
	}
	testkit.Eventually(t, 20*time.Second, "the extra worker to leave and its shards to come back", func() bool {

		return slices.Equal(b.shardLocks(t, cfg.ApplicationName), []int{0, relay.ShardCount})
	})

	for a := range aggs { // one event of every aggregate, so of shards of both workers
		b.enqueue(t, fmt.Sprintf("P-%03d", a), relaytest.SeqPayload{Seq: rounds + 1})
	}
	testkit.Eventually(t, 20*time.Second, "the events after the extra worker left", func() bool { return b.pending(t) == 0 })
	n := aggs * (rounds + 1)
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, n))
	if len(copies) != n {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), n)
	}
	want := map[string]int{}
	for a := range aggs {
		want[fmt.Sprintf("P-%03d", a)] = rounds + 1
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	t.Logf("rows per worker during the backlog %v", perWorker)
}
