package cdc_test

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
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
	s        *pgtest.Schema
	slotName string // the relay's default slot
	b        *kafkaembed.Broker
	pub      *kafka.Publisher
	ob       *outbox.Outbox
}

func setup(t testing.TB) *bundle {
	t.Helper()
	s := pgtest.NewMigratedSchema(t)
	b := kafkatest.New(t, topic)
	bu := &bundle{s: s, b: b, pub: kafka.NewPublisher(kafkatest.Client(t, b)),
		ob: outbox.New(outbox.Config{Names: s.Names(), MaxPayloadBytes: 4 << 20})}
	var db string
	if err := s.Pool.QueryRow(context.Background(), "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	bu.slotName = cdc.DefaultSlotIn(db, s.Names())
	t.Cleanup(func() { bu.dropSlot(t) })
	return bu
}

func (b *bundle) slot() string { return b.slotName }

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
	return testkit.Start(t, "relay", r.Run).Stop
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

// unconfirmedInserts counts the inserts the slot would stream again: its
// decoded changes after confirmed_flush_lsn, peeked (not consumed) once the
// slot is free.
func (b *bundle) unconfirmedInserts(t testing.TB) int {
	t.Helper()
	n := -1
	var last error
	testkit.Eventually(t, 10*time.Second, "the slot to be free to peek", func() bool {
		last = b.s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
			'proto_version', '1', 'publication_names', $2) WHERE get_byte(data, 0) = ascii('I')`,
			b.slot(), cdc.DefaultPublication(b.s.Names())).Scan(&n)
		return last == nil
	})
	return n
}

// confirmedLSN is the slot's confirmed_flush_lsn as a number (0: no slot).
func (b *bundle) confirmedLSN(t testing.TB) int64 {
	t.Helper()
	return int64(b.count(t, "SELECT coalesce((SELECT pg_wal_lsn_diff(confirmed_flush_lsn, '0/0') FROM pg_replication_slots WHERE slot_name = $1), 0)::int8", b.slot()))
}

// read returns the topic's records (in partition order), waiting for n.
func (b *bundle) read(t testing.TB, n int) []*kgo.Record {
	t.Helper()
	return relaytest.Read(t, b.b, topic, n)
}

// newWriters is the relays' concurrent-writers load on b's schema.
func newWriters(t testing.TB, b *bundle, aggs int) *relaytest.Writers {
	t.Helper()
	return relaytest.NewWriters(t, b.s.Pool, b.ob, aggs)
}
