package dlq_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/amqpdlq"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// On RabbitMQ too, a replay reaches only the consumer that failed: two
// consumers each have their own queue bound to the topic exchange; three
// events fail in both (six letters). Replaying the six delivers each event
// once to each consumer (each queue gets its own three back), and makes no
// new dead letter.
func TestReplayOnRabbitMQReachesOnlyTheConsumerThatFailed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := amqptest.Dial(t)
	db := pgtest.NewSchema(t)
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), dlq.Migrations, migrate.Inbox); err != nil {
		t.Fatal(err)
	}
	exchange := amqptest.Name("t.esdeveniments")
	amqptest.DeleteExchangesAtCleanup(t, exchange)
	const topic = "comandes.esdeveniments"
	var failing atomic.Bool
	failing.Store(true)
	type counted struct {
		mu      sync.Mutex
		applied map[string]int
		c       *consumer.Consumer
		queue   string
	}
	var queues []string
	start := func(name string) *counted {
		k := &counted{applied: map[string]int{}, queue: amqptest.Name("t." + name)}
		queues = append(queues, k.queue)
		src, err := amqp.NewSource(ctx, amqp.SourceConfig{Conn: conn, Queue: k.queue, Exchange: exchange, RoutingKeys: []string{topic}, Workers: 1})
		if err != nil {
			t.Fatal(err)
		}
		amqptest.DeleteQueuesAtCleanup(t, src.Queues)
		c, err := consumer.New(consumer.Config{Source: src, Pool: db.Pool, Names: db.Names(), Name: name,
			Inbox: inbox.New(inbox.Config{Names: db.Names()}), Backoff: 20 * time.Millisecond,
			Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				if failing.Load() {
					return outcome.Permanentf("prova: %s refuses it", name)
				}
				k.mu.Lock()
				k.applied[m.Envelope.ID]++
				k.mu.Unlock()
				return nil
			}})
		if err != nil {
			t.Fatal(err)
		}
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- c.Run(runCtx) }()
		t.Cleanup(func() { cancel(); <-done })
		k.c = c
		return k
	}
	a, b := start("comandes.pagament"), start("analitica.recompte")

	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: exchange})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close() //nolint:errcheck
	var ids []string
	for i := 0; i < 3; i++ {
		id := uuid.NewString()
		ids = append(ids, id)
		m := &transport.Message{Topic: topic, Key: []byte("P-" + id[:6]), Value: event(t, id, time.Now()),
			Headers: []transport.Header{{Key: "tipus", Value: "comanda.creada"}, {Key: "id_esdeveniment", Value: id}}}
		if err := pub.Publish(ctx, []*transport.Message{m}); err != nil {
			t.Fatal(err)
		}
	}
	backend, err := amqpdlq.New(amqpdlq.Config{Conn: conn, Queues: queues})
	if err != nil {
		t.Fatal(err)
	}
	defer backend.Close() //nolint:errcheck
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: dlq.NewStore(db.Pool, db.Name), Backend: backend})
	if err != nil {
		t.Fatal(err)
	}
	pending := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM cartes_mortes WHERE estat = 'pendent'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 30*time.Second, "6 letters indexed", func() bool {
		if _, err := svc.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		return pending() == 6
	})

	failing.Store(false)
	rep, err := svc.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
	if err != nil || rep.Done != 6 {
		t.Fatalf("replay: %+v %v", rep, err)
	}
	testkit.Eventually(t, 30*time.Second, "each consumer applying its 3 replays", func() bool {
		return a.c.Stats().Processed+a.c.Stats().Duplicates >= 3 && b.c.Stats().Processed+b.c.Stats().Duplicates >= 3
	})

	for _, k := range []*counted{a, b} {
		if st := k.c.Stats(); st.Processed != 3 || st.Duplicates != 0 || st.DeadLettered != 3 {
			t.Fatalf("%s: %+v; want 3 processed, 0 duplicates, 3 dead-lettered before the replay", k.queue, st)
		}
		for _, id := range ids {
			k.mu.Lock()
			n := k.applied[id]
			k.mu.Unlock()
			if n != 1 {
				t.Fatalf("%s applied %s %d time(s), want once", k.queue, id, n)
			}
		}
	}
	if res, err := svc.Sync(ctx); err != nil || len(res.New) != 0 {
		t.Fatalf("sync after the replay: %d new letter(s), %v; want 0", len(res.New), err)
	}
}
