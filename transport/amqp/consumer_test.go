package amqp_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

func publish(t *testing.T, b *bundle, msgs ...*transport.Message) {
	t.Helper()
	pub, err := amqp.NewPublisher(context.Background(), b.conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(context.Background(), msgs); err != nil {
		t.Fatal(err)
	}
}

func (b *bundle) consumerConfig(h consumer.Handler) consumerConfig {
	return consumerConfig{Conn: b.conn, Queue: b.queue, Pool: b.pool, Name: "prova.efecte", Inbox: b.inbox(),
		Handler: h, BackoffBase: 100 * time.Millisecond, Workers: 1}
}

// A poison message (malformed JSON) is dead-lettered
// natively at attempt 1, and the 500 messages queued behind it are all
// processed, none of them through a wait queue.
func TestPoisonGoesToDLQAtFirstAttemptAndTheRestFlows(t *testing.T) {
	b := setup(t)
	c, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return recordEffect(ctx, tx, m, 0)
	}))
	poison := &transport.Message{Topic: b.queue, Value: []byte(`{"id_esdeveniment": "x", "tipus": `),
		Headers: []transport.Header{{Key: contract.HeaderEventID, Value: "verinos-1"}}}
	msgs := []*transport.Message{poison}
	for i := range 500 {
		msgs = append(msgs, event(t, b.queue, "k", i))
	}
	publish(t, b, msgs...)
	testkit.Eventually(t, 30*time.Second, "500 effects", func() bool { n, _ := countEffects(t, b.db); return n == 500 })
	dlq := newTestDLQ(t, b.conn, b.queue)
	testkit.Eventually(t, 10*time.Second, "the poison message in the DLQ", func() bool { n, _ := dlq.Count(context.Background()); return n == 1 })
	st := c.Stats()
	if st.Processed != 500 || st.DeadLettered != 1 || st.Retried != 0 || st.Panics != 0 {
		t.Fatalf("stats %+v, want 500 processed, 1 dead-lettered, 0 retried", st)
	}
	dl, err := dlq.Show(context.Background(), "verinos-1")
	if err != nil {
		t.Fatal(err)
	}
	if dl.Attempts != 1 || !strings.HasPrefix(dl.Reason, "permanent: rejected by "+b.queue) || dl.Origin != b.queue {
		t.Fatalf("dead letter %+v: want a native rejection at attempt 1 from %s", dl, b.queue)
	}
}

// A transient failure is tried 3 times, with growing delays
// (100 ms then 200 ms, the TTLs of two wait queues), then lands in the DLQ
// with intents 3 and motiu "transitori esgotat: …"; no effect persists.
func TestTransientFailureIsRetriedWithGrowingDelaysThenDeadLettered(t *testing.T) {
	b := setup(t)
	var mu sync.Mutex
	var attempts []int
	var at []time.Time
	c, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := recordEffect(ctx, tx, m, 0); err != nil {
			return err
		}
		mu.Lock()
		attempts = append(attempts, m.Attempt)
		at = append(at, time.Now())
		mu.Unlock()
		return outcome.Transient(errors.New("mapes: 503 Service Unavailable"))
	}))
	ev := event(t, b.queue, "k", 1)
	publish(t, b, ev)
	dlq := newTestDLQ(t, b.conn, b.queue)
	testkit.Eventually(t, 20*time.Second, "the message in the DLQ", func() bool { n, _ := dlq.Count(context.Background()); return n == 1 })
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) != 3 || attempts[0] != 1 || attempts[1] != 2 || attempts[2] != 3 {
		t.Fatalf("attempts %v, want [1 2 3]", attempts)
	}
	// A TTL never fires early, so these lower bounds hold on any machine.
	if d1, d2 := at[1].Sub(at[0]), at[2].Sub(at[1]); d1 < 100*time.Millisecond || d2 < 200*time.Millisecond {
		t.Fatalf("delays %v and %v, want at least 100ms and 200ms", d1, d2)
	}
	id, _ := ev.Header(contract.HeaderEventID)
	dl, err := dlq.Show(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if dl.Attempts != 3 || dl.Reason != "transitori esgotat: mapes: 503 Service Unavailable" || dl.Origin != b.queue {
		t.Fatalf("dead letter %+v", dl)
	}
	if n, _ := countEffects(t, b.db); n != 0 {
		t.Fatalf("%d effects persisted from failed attempts, want 0", n)
	}
	if st := c.Stats(); st.Retried != 2 || st.DeadLettered != 1 {
		t.Fatalf("stats %+v", st)
	}
	wantQueues := []string{contract.WaitQueueName(b.queue, 100*time.Millisecond), contract.WaitQueueName(b.queue, 200*time.Millisecond)}
	for _, w := range wantQueues {
		found := false
		for _, q := range c.Queues() {
			found = found || q == w
		}
		if !found {
			t.Fatalf("wait queue %s not used; queues %v", w, c.Queues())
		}
	}
}

// Two transient failures and then success: the effect is applied once.
func TestTransientFailureThenSuccessAppliesTheEffectOnce(t *testing.T) {
	b := setup(t)
	var calls atomic.Int32
	c, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := recordEffect(ctx, tx, m, 0); err != nil {
			return err
		}
		if calls.Add(1) <= 2 {
			return errors.New("base de dades reiniciant") // unclassified: transient by default
		}
		return nil
	}))
	publish(t, b, event(t, b.queue, "k", 1))
	testkit.Eventually(t, 20*time.Second, "one effect", func() bool { n, _ := countEffects(t, b.db); return n == 1 })
	if st := c.Stats(); st.Processed != 1 || st.Retried != 2 || st.DeadLettered != 0 || calls.Load() != 3 {
		t.Fatalf("stats %+v after %d calls", st, calls.Load())
	}
}

func (b *bundle) inbox() *inbox.Inbox { return inbox.New(inbox.Config{Names: b.db.Names()}) }

// Acks are coalesced (multiple=true over settled runs of tags), yet a slow
// message must not hold back the acks behind it until the prefetch window
// is full: with prefetch 4 and the first message blocked, the 40 behind it
// are all processed while it waits.
func TestSlowMessageDoesNotStallTheMessagesBehindIt(t *testing.T) {
	b := setup(t)
	release := make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if string(m.Key) == "lent" {
			<-release
		}
		return recordEffect(ctx, tx, m, 0)
	})
	// One message per transaction: a batch waits for its slowest message
	// (as on Kafka); this proves the acks, not the batching.
	cfg.Workers, cfg.Prefetch, cfg.BatchSize = 2, 4, 1
	c, stop := startConsumer(t, cfg)
	t.Cleanup(free)
	msgs := []*transport.Message{event(t, b.queue, "lent", 0)}
	for i := range 40 {
		msgs = append(msgs, event(t, b.queue, "rapid", i))
	}
	publish(t, b, msgs...)
	testkit.Eventually(t, 20*time.Second, "the 40 fast messages processed while the slow one waits", func() bool { return c.Stats().Processed == 40 })
	free()
	testkit.Eventually(t, 10*time.Second, "the slow one", func() bool { return c.Stats().Processed == 41 })
	stop() // unacked deliveries would now be requeued
	if n := queueLen(t, b.conn, b.queue); n != 0 {
		t.Fatalf("%d messages back in the queue: their acks never reached the broker", n)
	}
}

// AtMostOnce acks before the effect, so a crash may lose a message; a clean
// stop must not. Stopped under load, every message the broker saw acked has
// its effect (the ones in hand finish with a context the stop does not
// cancel) and no delivery is acked after the stop: acked = effects, exactly.
func TestAtMostOnceCleanStopAppliesEveryAckedMessage(t *testing.T) {
	b := setup(t)
	const n = 2000
	cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		time.Sleep(3 * time.Millisecond) // a stop lands while handlers are inside their transactions
		return recordEffect(ctx, tx, m, 0)
	})
	cfg.Mode, cfg.Workers = consumer.AtMostOnce, 4
	c, stop := startConsumer(t, cfg)
	msgs := make([]*transport.Message, n)
	for i := range msgs {
		msgs[i] = event(t, b.queue, "k", i)
	}
	publish(t, b, msgs...)
	testkit.Eventually(t, 30*time.Second, "200 effects", func() bool { return c.Stats().Processed >= 200 })
	stop()
	effects, distinct := countEffects(t, b.db)
	// Unacked deliveries go back to the queue as the broker closes the
	// channel: let the count settle (it only grows) before comparing.
	left := queueLen(t, b.conn, b.queue)
	for range 50 {
		time.Sleep(20 * time.Millisecond)
		left = queueLen(t, b.conn, b.queue)
		if n-left == effects {
			break
		}
	}
	st := c.Stats()
	if n-left != effects || effects != distinct || int64(effects) != st.Processed || st.Retried+st.DeadLettered != 0 || effects == n {
		t.Fatalf("acked %d, effects %d (distinct %d), stats %+v: want every acked message applied once, none failed, some left",
			n-left, effects, distinct, st)
	}
}

// A work queue deleted while its consumer runs (an operator, a test
// cleanup, a policy) is declared again with its dead-letter topology: the
// consumer's Consume gets NOT_FOUND, redeclares what was registered for the
// queue and goes on; messages published afterwards are processed.
func TestConsumerRedeclaresItsQueueWhenItIsDeleted(t *testing.T) {
	b := setup(t)
	c, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return recordEffect(ctx, tx, m, 0)
	}))
	batch := func(from int) []*transport.Message {
		var msgs []*transport.Message
		for i := range 10 {
			msgs = append(msgs, event(t, b.queue, "k", from+i))
		}
		return msgs
	}
	publish(t, b, batch(0)...)
	testkit.Eventually(t, 10*time.Second, "10 effects", func() bool { return c.Stats().Processed == 10 })
	if err := b.conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		_, err := ch.QueueDelete(b.queue, false, false, false)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "the queue declared again", func() bool {
		return b.conn.Do(context.Background(), func(ch *amqp091.Channel) error {
			_, err := ch.QueueDeclarePassive(b.queue, true, false, false, false, nil)
			return err
		}) == nil
	})

	publish(t, b, batch(10)...)
	testkit.Eventually(t, 30*time.Second, "20 effects", func() bool { return c.Stats().Processed == 20 })
	if rows, distinct := countEffects(t, b.db); rows != 20 || distinct != 20 {
		t.Fatalf("%d effects (%d distinct), want 20", rows, distinct)
	}
	// The queue came back with its dead-letter arguments: a poison message
	// still reaches the DLQ.
	publish(t, b, &transport.Message{Topic: b.queue, Value: []byte(`{`)})
	dlq := newTestDLQ(t, b.conn, b.queue)
	testkit.Eventually(t, 10*time.Second, "the poison message in the DLQ", func() bool { n, _ := dlq.Count(context.Background()); return n == 1 })
}
