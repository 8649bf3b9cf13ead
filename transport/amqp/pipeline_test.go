package amqp_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
)

// What RabbitMQ consumers gain from the shared pipeline, proven on
// RabbitMQ. Failure point: PostgreSQL aborts the transaction with a
// serialisation failure (SQLSTATE 40001, raised by the server) on the first
// try of a message. The transaction is rerun in place: no wait queue, no
// attempt spent (the handler's second run sees attempt 1), one effect.
func TestConflictIsRerunInPlaceWithoutSpendingAnAttempt(t *testing.T) {
	b := setup(t)
	var calls atomic.Int32
	var attempts []int
	var mu sync.Mutex
	c, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		attempts = append(attempts, m.Attempt)
		mu.Unlock()
		if calls.Add(1) == 1 {
			_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'conflicte simulat' USING ERRCODE = '40001'; END $$`)
			return err
		}
		return recordEffect(ctx, tx, m, 0)
	}))
	publish(t, b, event(t, b.queue, "k", 1))
	testkit.Eventually(t, 10*time.Second, "the message processed", func() bool { return c.Stats().Processed == 1 })
	st := c.Stats()
	rows, _ := countEffects(t, b.db)
	mu.Lock()
	defer mu.Unlock()
	if st.Conflicts != 1 || st.Retried != 0 || st.DeadLettered != 0 || rows != 1 || fmt.Sprint(attempts) != "[1 1]" {
		t.Fatalf("stats %+v, %d effects, attempts %v: want 1 conflict rerun in place, no retry, 1 effect, attempts [1 1]",
			st, rows, attempts)
	}
	for _, q := range c.Queues() {
		if n := queueLen(t, b.conn, q); n != 0 {
			t.Fatalf("queue %s holds %d: a conflict must not leave the work queue", q, n)
		}
	}
}

// Batching on RabbitMQ: the deliveries the broker already pushed to a
// worker share one transaction (HandleBatch gets several at once), each with
// its own key; every effect is applied once.
func TestHandleBatchTakesSeveralDeliveriesInOneTransaction(t *testing.T) {
	b := setup(t)
	const n = 200
	msgs := make([]*transport.Message, n)
	for i := range msgs {
		msgs[i] = event(t, b.queue, "k", i)
	}
	var largest atomic.Int64
	var first sync.Once
	cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		// The first delivery comes alone; while it is handled, let the
		// broker fill the prefetch window, so the next take is a batch.
		first.Do(func() {
			testkit.Eventually(t, 10*time.Second, "the prefetch window filled", func() bool { return queueLen(t, b.conn, b.queue) <= n-64 })
		})
		return recordEffect(ctx, tx, m, 0)
	})
	cfg.Prefetch, cfg.BatchSize = 64, 32
	cfg.HandleBatch = func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
		first.Do(func() {
			testkit.Eventually(t, 10*time.Second, "the prefetch window filled", func() bool { return queueLen(t, b.conn, b.queue) <= n-64 })
		})
		if int64(len(ms)) > largest.Load() {
			largest.Store(int64(len(ms)))
		}
		for _, m := range ms {
			if err := recordEffect(ctx, tx, m, 0); err != nil {
				return err
			}
		}
		return nil
	}
	// The queue exists (declared by the source) before the messages come:
	// publish first, then consume, so the broker pushes full windows.
	c, err := newConsumer(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	publish(t, b, msgs...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	testkit.Eventually(t, 30*time.Second, "every message processed", func() bool { return c.Stats().Processed == n })
	rows, distinct := countEffects(t, b.db)
	// How many deliveries the client holds when a worker takes depends on
	// the machine's load; what must hold is that a take is a batch (more than
	// one) and never more than BatchSize.
	if rows != n || distinct != n || largest.Load() < 2 || largest.Load() > 32 {
		t.Fatalf("%d effects (%d distinct), largest batch %d: want %d once each, batches of 2 up to BatchSize (32)", rows, distinct, largest.Load(), n)
	}
}

// The Decode hook on RabbitMQ: schema validation and upcasting plug in. A
// decoder that upcasts version 1 to 2 and ignores (outcome.ErrIgnore) a
// version it does not know: the handler sees version 2, the unknown one is
// acked and counted as ignored, nothing is dead-lettered.
func TestDecodeHookUpcastsAndIgnoresOnRabbitMQ(t *testing.T) {
	b := setup(t)
	var versions []int
	var mu sync.Mutex
	cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		versions = append(versions, m.Envelope.Version)
		mu.Unlock()
		return recordEffect(ctx, tx, m, 0)
	})
	cfg.Decode = func(raw []byte) (*envelope.Envelope, error) {
		env, err := envelope.Decode(raw)
		if err != nil {
			return nil, err
		}
		switch env.Version {
		case 1:
			env.Version = 2 // the upcaster
		case 9:
			return nil, fmt.Errorf("versio 9: %w", outcome.ErrIgnore)
		}
		return env, nil
	}
	c, _ := startConsumer(t, cfg)
	future := event(t, b.queue, "k", 2)
	env, err := envelope.Decode(future.Value)
	if err != nil {
		t.Fatal(err)
	}
	env.Version = 9
	if future.Value, err = env.Encode(); err != nil {
		t.Fatal(err)
	}
	publish(t, b, event(t, b.queue, "k", 1), future)
	testkit.Eventually(t, 10*time.Second, "both deliveries settled", func() bool { st := c.Stats(); return st.Processed+st.Ignored == 2 })
	mu.Lock()
	defer mu.Unlock()
	if st := c.Stats(); st.Processed != 1 || st.Ignored != 1 || st.DeadLettered != 0 || fmt.Sprint(versions) != "[2]" {
		t.Fatalf("stats %+v, versions seen %v: want 1 processed at version 2 and 1 ignored", st, versions)
	}
}
