package relay_test

import (
	"context"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

const topic = "comandes.esdeveniments"

// bundle is one test's world: a migrated schema, a kfake broker with the
// topic, a publisher and an outbox writer.
type bundle struct {
	s   *pgtest.Schema
	b   *kafkaembed.Broker
	pub *kafka.Publisher
	ob  *outbox.Outbox
}

func setup(t testing.TB) *bundle {
	t.Helper()
	return setupWith(t, kafkaembed.Config{Topics: []string{topic}})
}

func setupWith(t testing.TB, kcfg kafkaembed.Config, opts ...kgo.Opt) *bundle {
	t.Helper()
	s := pgtest.NewMigratedSchema(t)
	b := kafkatest.NewWith(t, kcfg)
	return &bundle{s: s, b: b, pub: kafka.NewPublisher(kafkatest.Client(t, b, opts...)),
		ob: outbox.New(outbox.Config{Names: s.Names(), MaxPayloadBytes: 4 << 20})}
}

func testLogger() *slog.Logger {
	lvl := slog.LevelError + 1
	if os.Getenv("KM0_TEST_LOG") != "" {
		lvl = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
}

// config is a relay config for the bundle with test-sized timings.
func (b *bundle) config() relay.Config {
	return relay.Config{
		Pool: b.s.Pool, Names: b.s.Names(), Publisher: b.pub, Topic: topic, Origin: "comandes",
		Workers: 1, PollInterval: 20 * time.Millisecond, RebalanceInterval: 20 * time.Millisecond,
		BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond, PublishTimeout: 2 * time.Second,
		ApplicationName: "km0-relay-" + b.s.Name, Logger: testLogger(),
	}
}

func (b *bundle) newRelay(t testing.TB, cfg relay.Config) *relay.Relay {
	t.Helper()
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}

// start runs r in the background; the returned stop cancels it and returns
// Run's error. Cleanup stops it too.
func start(t testing.TB, r *relay.Relay) (stop func() error) {
	t.Helper()
	return testkit.Start(t, "relay", func(ctx context.Context) error {
		if h, ok := probes.Load(r); ok {
			ctx = faults.WithRelay(ctx, h.(faults.Relay))
		}
		return r.Run(ctx)
	}).Stop
}

// enqueue writes one event for aggregate agg in its own transaction.
func (b *bundle) enqueue(t testing.TB, agg string, payload any) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	tx, err := b.s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	e := &outbox.Event{Aggregate: "comanda", AggregateID: agg, Type: "comanda.creada", Payload: payload}
	if err := b.ob.Enqueue(ctx, tx, e); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
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

// drainOnce runs r.RunOnce until nothing is pending (at most 100 passes).
func (b *bundle) drainOnce(t testing.TB, r *relay.Relay) int {
	t.Helper()
	total := 0
	for range 100 {
		n, err := r.RunOnce(ctxFor(r))
		if err != nil {
			t.Fatal(err)
		}
		total += n
		if n == 0 {
			return total
		}
	}
	t.Fatal("relay did not drain in 100 passes")
	return total
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

// probes are the crash points and probes (internal/faults) of the relays of
// the tests, which carry them in the context of Run and RunOnce.
var probes sync.Map // *relay.Relay → faults.Relay

// withProbes gives r the crash points and probes h.
func withProbes(r *relay.Relay, h faults.Relay) { probes.Store(r, h) }

// ctxFor returns a context carrying r's probes, if any.
func ctxFor(r *relay.Relay) context.Context {
	if h, ok := probes.Load(r); ok {
		return faults.WithRelay(context.Background(), h.(faults.Relay))
	}
	return context.Background()
}
