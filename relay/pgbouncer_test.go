package relay_test

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgbouncer"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// Behind Debian's PgBouncer (1.18 on bookworm) in front of a private
// cluster. Transaction pooling breaks LISTEN silently and keeps no session
// between transactions: the relay's self-test must see it, warn naming the
// cause, poll, and own its shards per transaction, so that two instances of
// two workers each still publish every event once and in commit order per
// aggregate while writers commit. Session pooling keeps LISTEN and the
// session locks: no fallback. In both modes a consumer whose inbox goes
// through the bouncer then applies each event once and absorbs a copy of
// each (the services' pools carry default_query_exec_mode=cache_describe,
// as docs/deploying.md says for PgBouncer before 1.21).
func TestRelayBehindPgBouncer(t *testing.T) {
	t.Parallel()
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	if v, err := pgbouncer.Version(""); err == nil {
		t.Log(v)
	}
	for _, mode := range []string{pgbouncer.Transaction, pgbouncer.Session} {
		t.Run(mode, func(t *testing.T) {
			ctx := context.Background()
			db := "km0_" + mode
			admin := pgxpoolFor(t, c.URL)
			if _, err := admin.Exec(ctx, "CREATE DATABASE "+db); err != nil {
				t.Fatal(err)
			}
			direct := pgxpoolFor(t, strings.Replace(c.URL, "/postgres?", "/"+db+"?", 1))
			if _, err := migrate.Up(ctx, direct, migrate.Names{}, migrate.Outbox); err != nil {
				t.Fatal(err)
			}
			// Transaction pooling shares 4 server sessions among the 10
			// clients; session pooling needs one per client.
			size := map[string]int{pgbouncer.Transaction: 4, pgbouncer.Session: 20}[mode]
			b, err := pgbouncer.Start(pgbouncer.Options{Upstream: "127.0.0.1:" + strconv.Itoa(c.Port), Mode: mode, PoolSize: size})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(b.Stop)
			broker := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{topic}})
			ob := outbox.New(outbox.Config{})
			writers := relaytest.NewWriters(t, direct, ob, 8)

			var logs testlog.Buffer
			var relays []*relay.Relay
			for range 2 {
				r, err := relay.New(relay.Config{
					// The services' own pools need the URL parameter behind
					// PgBouncer < 1.21 (docs/deploying.md); the relay's
					// sessions switch by themselves.
					DatabaseURL: b.URL(db, "default_query_exec_mode=cache_describe"),
					Publisher:   kafka.NewPublisher(kafkatest.Client(t, broker)), Topic: topic, Origin: "comandes",
					Workers: 2, PollInterval: 20 * time.Millisecond, RebalanceInterval: 20 * time.Millisecond,
					ListenCheckTimeout: 500 * time.Millisecond,
					Logger:             slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
				})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(r.Close)
				relays = append(relays, r)
			}
			if err := writers.Run(ctx, 2, 25, 7); err != nil { // before the relays start
				t.Fatal(err)
			}
			for _, r := range relays {
				start(t, r)
			}
			if err := writers.Run(ctx, 4, 50, 11); err != nil { // while they run
				t.Fatal(err)
			}
			want := writers.Counts(t)
			total := relaytest.Total(want)
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("relay logs:\n%s", logs.String())
				}
			})
			testkit.Eventually(t, 60*time.Second, "every event published", func() bool {
				var n int
				if err := direct.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL").Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n == 0
			})

			recs := kafkatest.ReadTopic(t, broker, topic, 60*time.Second)
			if len(recs) != total {
				t.Fatalf("%d records on the topic, want %d (each event once)", len(recs), total)
			}
			perKey, perID := relaytest.FirstSeqs(t, recs)
			for id, n := range perID {
				if n != 1 {
					t.Fatalf("event %s published %d times", id, n)
				}
			}
			relaytest.CheckCommitOrder(t, perKey, want)

			fellBack := strings.Count(logs.String(), "falling back to polling")
			for i, r := range relays {
				if got, wantPooled := r.Pooled(), mode == pgbouncer.Transaction; got != wantPooled {
					t.Errorf("relay %d: Pooled() = %v behind %s pooling, want %v", i, got, mode, wantPooled)
				}
			}
			switch mode {
			case pgbouncer.Transaction:
				if fellBack != 2 || !strings.Contains(logs.String(), "PgBouncer") {
					t.Fatalf("want one fallback warning naming PgBouncer per relay, got %d in:\n%s", fellBack, logs.String())
				}
			default:
				if fellBack != 0 {
					t.Fatalf("session pooling: %d fallback warnings, want none:\n%s", fellBack, logs.String())
				}
			}

			// A consumer with its inbox on the same pooled connections,
			// fed every event twice (the relay's records, then copies):
			// each effect applied once, each copy absorbed.
			if err := kafka.NewPublisher(kafkatest.Client(t, broker)).Publish(ctx, copies(recs)); err != nil {
				t.Fatal(err)
			}
			pooledPool := pgxpoolFor(t, b.URL(db, "default_query_exec_mode=cache_describe"))
			if _, err := migrate.Up(ctx, pooledPool, migrate.Names{}, migrate.Inbox); err != nil {
				t.Fatal(err)
			}
			if _, err := direct.Exec(ctx, "CREATE TABLE aplicats (id TEXT PRIMARY KEY, n INT NOT NULL)"); err != nil {
				t.Fatal(err)
			}
			src, err := kafka.NewSource(kafka.SourceConfig{Brokers: broker.Addrs(), Group: "proves-" + mode, Topics: []string{topic}})
			if err != nil {
				t.Fatal(err)
			}
			cons, err := consumer.New(consumer.Config{
				Source: src,
				Name:   "proves.aplica", Pool: pooledPool, Types: []string{"comanda.creada"},
				Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
					_, err := tx.Exec(ctx, "INSERT INTO aplicats VALUES ($1, 1) ON CONFLICT (id) DO UPDATE SET n = aplicats.n + 1", m.Envelope.ID)
					return err
				},
				Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
			})
			if err != nil {
				t.Fatal(err)
			}
			runCtx, stopConsumer := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- cons.Run(runCtx) }()
			testkit.Eventually(t, 60*time.Second, "the consumer to settle every delivery", func() bool {
				st := cons.Stats()
				return st.Processed+st.Duplicates >= int64(2*total)
			})

			stopConsumer()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			var applied, once int
			if err := direct.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE n = 1) FROM aplicats").Scan(&applied, &once); err != nil {
				t.Fatal(err)
			}
			if st := cons.Stats(); st.Processed != int64(total) || st.Duplicates != int64(total) || applied != total || once != total {
				t.Fatalf("consumer: processed %d, duplicates %d; %d effects, %d applied once; want %d, %d, %d, %d",
					st.Processed, st.Duplicates, applied, once, total, total, total, total)
			}
			t.Logf("%s pooling: %d events over %d aggregates, each published once and in order, each applied once", mode, total, len(want))
		})
	}
}

// copies are recs again, as a redelivery would bring them.
func copies(recs []*kgo.Record) []*transport.Message {
	out := make([]*transport.Message, len(recs))
	for i, r := range recs {
		m := &transport.Message{Topic: r.Topic, Key: r.Key, Value: r.Value}
		for _, h := range r.Headers {
			m.Headers = append(m.Headers, transport.Header{Key: h.Key, Value: string(h.Value)})
		}
		out[i] = m
	}
	return out
}

func pgxpoolFor(t *testing.T, u string) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}
