package cdc_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport/kafka"
)

// The shared server has wal_level = replica and must not be restarted: the
// package runs against a private cluster with wal_level = logical.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	os.Exit(pgtest.RunWithCluster(m, pgcluster.Options{}))
}

const topic = "comandes.esdeveniments"

// bundle is one test's world: a migrated schema on the private cluster, a
// kfake broker with the topic, a publisher and an outbox writer. The slot
// and the publication of the schema are dropped at cleanup.
type bundle struct {
	s   *pgtest.Schema
	b   *kafka.Embedded
	pub *kafka.Publisher
	ob  *outbox.Outbox
}

func setup(t testing.TB) *bundle {
	t.Helper()
	s := pgtest.NewMigratedSchema(t)
	b := kafkatest.New(t, topic)
	bu := &bundle{s: s, b: b, pub: kafka.NewPublisher(kafkatest.Client(t, b)),
		ob: outbox.New(outbox.Config{Names: s.Names(), MaxPayloadBytes: 4 << 20})}
	t.Cleanup(func() { bu.dropSlot(t) })
	return bu
}

func (b *bundle) slot() string { return cdc.DefaultSlot(b.s.Names()) }

// dropSlot drops the schema's slot and publication, waiting (a little) for a
// killed holder's session to end.
func (b *bundle) dropSlot(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	end := time.Now().Add(10 * time.Second)
	for {
		_, err := b.s.Pool.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1", b.slot())
		if err == nil {
			break
		}
		if time.Now().After(end) {
			t.Errorf("drop slot %s: %v", b.slot(), err)
			break
		}
		time.Sleep(50 * time.Millisecond) // polling for the holder's session to end, with a deadline
	}
	if _, err := b.s.Pool.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{cdc.DefaultPublication(b.s.Names())}.Sanitize()); err != nil {
		t.Errorf("drop publication: %v", err)
	}
}

func testLogger() *slog.Logger {
	lvl := slog.LevelError + 1
	if os.Getenv("KM0_TEST_LOG") != "" {
		lvl = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
}

// config is a CDC relay config for the bundle with test-sized timings.
func (b *bundle) config() cdc.Config {
	return cdc.Config{
		Config: relay.Config{Pool: b.s.Pool, Names: b.s.Names(), Publisher: b.pub, Topic: topic, Origin: "comandes",
			BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond, PublishTimeout: 5 * time.Second,
			ApplicationName: "km0-relay-cdc-" + b.s.Name, Logger: testLogger()},
		StatusInterval: 100 * time.Millisecond, ReleaseCheck: 50 * time.Millisecond,
	}
}

func (b *bundle) pollingConfig() relay.Config {
	return relay.Config{
		Pool: b.s.Pool, Names: b.s.Names(), Publisher: b.pub, Topic: topic, Origin: "comandes",
		Workers: 1, PollInterval: 20 * time.Millisecond, RebalanceInterval: 20 * time.Millisecond,
		BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond, PublishTimeout: 5 * time.Second,
		ApplicationName: "km0-relay-" + b.s.Name, Logger: testLogger(),
	}
}

func newRelay(t testing.TB, cfg cdc.Config) *cdc.Relay {
	t.Helper()
	r, err := cdc.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}

type runner interface{ Run(context.Context) error }

// withFaults runs r with the crash points fx (internal/faults) in its
// context.
type withFaults struct {
	r  runner
	fx faults.CDC
}

func (w withFaults) Run(ctx context.Context) error { return w.r.Run(faults.WithCDC(ctx, w.fx)) }

// start runs r in the background; the returned stop cancels it and returns
// Run's error. Cleanup stops it too.
func start(t testing.TB, r runner) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(20 * time.Second):
				err = errors.New("relay did not stop within 20s")
			}
		})
		return err
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("relay: %v", err)
		}
	})
	return stop
}

// runUntilError runs r until it returns (a crash hook) and returns its error.
func runUntilError(t testing.TB, r runner, deadline time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	err := r.Run(ctx)
	if ctx.Err() != nil {
		t.Fatalf("relay did not stop by itself within %v (err %v)", deadline, err)
	}
	return err
}

// enqueue writes one event for aggregate agg in its own transaction.
func (b *bundle) enqueue(t testing.TB, agg string, payload any) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	e := &outbox.Event{Aggregate: "comanda", AggregateID: agg, Type: "comanda.creada", Payload: payload}
	if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.Enqueue(ctx, tx, e) }); err != nil {
		t.Fatal(err)
	}
	return e.ID
}

func (b *bundle) count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := b.s.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func (b *bundle) pending(t testing.TB) int {
	t.Helper()
	return b.count(t, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL")
}

// confirmedLSN is the slot's confirmed_flush_lsn as a number (0: no slot).
func (b *bundle) confirmedLSN(t testing.TB) int64 {
	t.Helper()
	return int64(b.count(t, "SELECT coalesce((SELECT pg_wal_lsn_diff(confirmed_flush_lsn, '0/0') FROM pg_replication_slots WHERE slot_name = $1), 0)::int8", b.slot()))
}

// waitFor polls cond every 10 ms until it holds or the deadline passes.
func waitFor(t testing.TB, what string, deadline time.Duration, cond func() bool) {
	t.Helper()
	end := time.Now().Add(deadline)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out after %v waiting for %s", deadline, what)
		}
		time.Sleep(10 * time.Millisecond) // polling with a deadline, not waiting for work
	}
}

// read returns the topic's records (in partition order), waiting for n.
func (b *bundle) read(t testing.TB, n int) []*kgo.Record {
	t.Helper()
	recs := kafkatest.ReadAll(t, b.b, topic, n, 20*time.Second)
	if len(recs) < n {
		t.Fatalf("topic has %d records, want at least %d", len(recs), n)
	}
	return recs
}

// seqPayload is the payload of ordered events: seq is the aggregate's commit
// order, taken under a row lock of the writer's transaction.
type seqPayload struct {
	Seq int `json:"seq"`
}

// firstSeqs decodes the records and returns, per key, the seq of each event
// id at its first occurrence, in topic order; and the number of records per
// id.
func firstSeqs(t testing.TB, recs []*kgo.Record) (map[string][]int, map[string]int) {
	t.Helper()
	perKey := map[string][]int{}
	copies := map[string]int{}
	for _, r := range recs {
		env, err := envelope.Decode(r.Value)
		if err != nil {
			t.Fatalf("record at %d/%d: %v", r.Partition, r.Offset, err)
		}
		copies[env.ID]++
		if copies[env.ID] > 1 {
			continue
		}
		var p seqPayload
		if err := json.Unmarshal(env.Data, &p); err != nil {
			t.Fatal(err)
		}
		perKey[string(r.Key)] = append(perKey[string(r.Key)], p.Seq)
	}
	return perKey, copies
}

// checkCommitOrder asserts that every aggregate's events arrived, by first
// occurrence, as 1, 2, ..., want[agg]: nothing missing, commit order kept.
func checkCommitOrder(t testing.TB, perKey map[string][]int, want map[string]int) {
	t.Helper()
	bad := 0
	for agg, n := range want {
		got := perKey[agg]
		ok := len(got) == n
		for i := 0; ok && i < n; i++ {
			ok = got[i] == i+1
		}
		if !ok {
			bad++
			if bad <= 5 {
				t.Errorf("aggregate %s: got seqs %v, want 1..%d in order", agg, clipInts(got), n)
			}
		}
	}
	if len(perKey) != len(want) {
		t.Errorf("%d keys on the topic, want %d", len(perKey), len(want))
	}
	if bad > 0 {
		t.Fatalf("%d of %d aggregates out of commit order or incomplete", bad, len(want))
	}
}

func clipInts(s []int) string {
	if len(s) > 20 {
		return fmt.Sprint(s[:20]) + "…"
	}
	return fmt.Sprint(s)
}

// writers runs goroutines that each commit transactions; each transaction
// bumps the counters of 2 random aggregates (taking their row locks, so the
// counter value is the aggregate's commit order) and enqueues one event per
// aggregate carrying that value. It is the polling relay's concurrent-writers
// load (relay/helpers_test.go).
type writers struct {
	b    *bundle
	aggs []string
}

func newWriters(t testing.TB, b *bundle, aggs int) *writers {
	t.Helper()
	ctx := context.Background()
	if _, err := b.s.Pool.Exec(ctx, "CREATE TABLE comptadors (agregat_id TEXT PRIMARY KEY, n INT NOT NULL DEFAULT 0)"); err != nil {
		t.Fatal(err)
	}
	w := &writers{b: b}
	for i := range aggs {
		w.aggs = append(w.aggs, fmt.Sprintf("P-%05d", i))
	}
	if _, err := b.s.Pool.Exec(ctx, "INSERT INTO comptadors (agregat_id) SELECT unnest($1::text[])", w.aggs); err != nil {
		t.Fatal(err)
	}
	return w
}

// run commits n×txs transactions with n concurrent writers and returns the
// first error.
func (w *writers) run(ctx context.Context, n, txs int, seed uint64) error {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for g := range n {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(seed+uint64(g)*7919, seed^0x9e3779b97f4a7c15))
			for range txs {
				a, b := w.aggs[rnd.IntN(len(w.aggs))], w.aggs[rnd.IntN(len(w.aggs))]
				if b < a {
					a, b = b, a
				}
				if err := w.one(ctx, a, b); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func (w *writers) one(ctx context.Context, aggs ...string) error {
	return pgx.BeginFunc(ctx, w.b.s.Pool, func(tx pgx.Tx) error {
		var events []*outbox.Event
		seen := map[string]bool{}
		for _, a := range aggs {
			if seen[a] {
				continue
			}
			seen[a] = true
			var n int
			if err := tx.QueryRow(ctx, "UPDATE comptadors SET n = n + 1 WHERE agregat_id = $1 RETURNING n", a).Scan(&n); err != nil {
				return err
			}
			events = append(events, &outbox.Event{Aggregate: "comanda", AggregateID: a, Type: "comanda.creada",
				Payload: seqPayload{Seq: n}})
		}
		return w.b.ob.EnqueueBatch(ctx, tx, events)
	})
}

// counts returns each aggregate's final counter (events written).
func (w *writers) counts(t testing.TB) map[string]int {
	t.Helper()
	rows, err := w.b.s.Pool.Query(context.Background(), "SELECT agregat_id, n FROM comptadors WHERE n > 0")
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
		a string
		n int
	}, error) {
		var v struct {
			a string
			n int
		}
		err := r.Scan(&v.a, &v.n)
		return v, err
	})
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]int{}
	for _, v := range out {
		m[v.a] = v.n
	}
	return m
}

func total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}
