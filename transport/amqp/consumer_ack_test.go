package amqp_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
)

// CONTRACT 1 (K1, K2). Crash point: the consumer stops (and its shutdown
// timeout passes) while a handler is
// inside the effect's transaction, after a later delivery of the same
// channel committed (its ack is due). The message in hand was never acked:
// the broker takes it back, no effect of it persisted, and the next consumer
// applies it once. An ack sent before the transaction, or a coalesced
// multiple ack reaching over the unfinished tag, loses it.
func TestStopInsideTheEffectLeavesTheMessageOnTheBroker(t *testing.T) {
	b := setup(t)
	inside := make(chan struct{})
	var once sync.Once
	cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := recordEffect(ctx, tx, m, 0); err != nil {
			return err
		}
		if string(m.Key) == "lent" {
			once.Do(func() { close(inside) })
			<-ctx.Done() // the stop lands while the effect's transaction is open, and outlasts the shutdown timeout
			return ctx.Err()
		}
		return nil
	})
	cfg.Workers, cfg.Prefetch = 2, 8
	cfg.ShutdownTimeout = 100 * time.Millisecond // past it the stop abandons the effect in hand
	c, stop := startConsumer(t, cfg)
	slow := event(t, b.queue, "lent", 0)
	publish(t, b, slow)
	testkit.Eventually(t, 10*time.Second, "the slow handler inside its transaction", func() bool {
		select {
		case <-inside:
			return true
		default:
			return false
		}
	})

	publish(t, b, event(t, b.queue, "rapid", 1))
	testkit.Eventually(t, 10*time.Second, "the fast message committed", func() bool { return c.Stats().Processed == 1 })
	stop()
	testkit.Eventually(t, 10*time.Second, "the slow message back on the broker", func() bool { return queueLen(t, b.conn, b.queue) == 1 })
	if rows, _ := countEffects(t, b.db); rows != 1 {
		t.Fatalf("%d effects after the stop, want 1 (the fast message only)", rows)
	}

	c2, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return recordEffect(ctx, tx, m, 0)
	}))
	testkit.Eventually(t, 10*time.Second, "the slow message applied by the next consumer", func() bool { return c2.Stats().Processed == 1 })
	rows, distinct := countEffects(t, b.db)
	if rows != 2 || distinct != 2 || queueLen(t, b.conn, b.queue) != 0 {
		t.Fatalf("%d effects (%d distinct), %d left in the queue; want 2, 2, 0", rows, distinct, queueLen(t, b.conn, b.queue))
	}
}

// CONTRACT 1 and 6 (K4, K7). Failure point: the retry copy cannot be
// published (its wait queue was deleted after the consumer declared it, so
// the broker returns the copy). The original was not acked before the copy
// was confirmed: it is rejected without requeue and lands in the DLQ, never
// lost. Acking first loses it (and the nack after it closes the channel).
func TestRetryCopyThatCannotBePublishedDeadLettersTheOriginal(t *testing.T) {
	b := setup(t)
	var calls atomic.Int32
	c, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := recordEffect(ctx, tx, m, 0); err != nil {
			return err
		}
		if m.Attempt == 1 {
			calls.Add(1)
			return outcome.Transient(errors.New("mapes: 503"))
		}
		return nil
	}))
	publish(t, b, event(t, b.queue, "k", 1)) // declares the 100 ms wait queue
	testkit.Eventually(t, 10*time.Second, "the first message retried and applied", func() bool { return c.Stats().Processed == 1 })
	wait := contract.WaitQueueName(b.queue, 100*time.Millisecond)
	if err := b.conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		_, err := ch.QueueDelete(wait, false, false, false)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	lost := event(t, b.queue, "k", 2)
	publish(t, b, lost)
	dlq := newTestDLQ(t, b.conn, b.queue)
	testkit.Eventually(t, 10*time.Second, "the second message in the DLQ", func() bool { n, _ := dlq.Count(context.Background()); return n == 1 })
	id, _ := lost.Header("id_esdeveniment")
	dl, err := dlq.Show(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	rows, _ := countEffects(t, b.db)
	if st := c.Stats(); rows != 1 || calls.Load() != 2 || st.Retried != 1 || st.DeadLettered != 1 || dl.Origin != b.queue || queueLen(t, b.conn, b.queue) != 0 {
		t.Fatalf("effects %d, failed calls %d, stats %+v, dead letter %+v; want 1 effect, 2 failed calls, 1 retried, 1 dead-lettered from %s",
			rows, calls.Load(), st, dl, b.queue)
	}
}
