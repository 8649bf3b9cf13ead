package amqp_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// RabbitMQ is restarted (rabbitmqctl stop_app / start_app) in the
// middle of a 5,000-message publish-and-consume run. Every message is
// processed, and the effect count is exactly 5,000.
//
// Crash point: the broker stops while handlers are inside their transactions
// (from the 1,000th message on, every handler waits for the stop): their
// effects commit after the broker is gone, so their acks are lost; the
// broker redelivers those messages after the restart and the inbox turns them
// into duplicates. The publisher stays at most 1,500 messages ahead of the
// consumer, so at the stop it still has more than 2,000 messages to publish,
// which it does after reconnecting.
//
// This test stops the shared broker: it holds the restart lock exclusively,
// and start_app runs in a cleanup whatever happens.
func TestBrokerRestartLosesNothingAndAppliesEveryEffectOnce(t *testing.T) {
	amqptest.Exclusive(t)
	const total, window, gateAt = 5000, 1500, 1000
	conn := amqptest.DialUnlocked(t)
	db := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE efectes (n BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, clau TEXT, seq INT, instancia INT)`); err != nil {
		t.Fatal(err)
	}
	b := &bundle{conn: conn, db: db, pool: pgtest.NewPool(t, db.URL+"&synchronous_commit=off", 6), queue: amqptest.Name("t.restart")}

	var handled atomic.Int64
	gate := make(chan struct{})   // closed once the broker is stopped
	atGate := make(chan struct{}) // closed when the first handler waits at the gate
	var atGateOnce sync.Once
	cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := recordEffect(ctx, tx, m, 0); err != nil {
			return err
		}
		if handled.Add(1) >= gateAt {
			atGateOnce.Do(func() { close(atGate) })
			<-gate
		}
		return nil
	})
	cfg.Workers, cfg.Prefetch = 4, 50
	c, _ := startConsumer(t, cfg)
	release := sync.OnceFunc(func() { close(gate) })
	t.Cleanup(release) // runs before the consumer's stop, even after a failure

	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var published atomic.Int64
	var publishErrors atomic.Int64
	pubDone := make(chan struct{})
	go func() {
		defer close(pubDone)
		for published.Load() < total {
			// Flow control: stay at most `window` messages ahead of the consumer.
			for published.Load()-c.Stats().Processed >= window {
				select {
				case <-time.After(5 * time.Millisecond):
				case <-ctx.Done():
					return
				}
			}
			batch := make([]*transport.Message, 0, 50)
			for i := range 50 {
				batch = append(batch, event(t, b.queue, "k", int(published.Load())+i))
			}
			// Like the relay: a batch is done only when confirmed; on any error
			// it is published again (duplicates carry the same id_esdeveniment).
			for {
				pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				err := pub.Publish(pctx, batch)
				cancel()
				if err == nil {
					break
				}
				publishErrors.Add(1)
			}
			published.Add(int64(len(batch)))
		}
	}()

	select {
	case <-atGate:
	case <-time.After(60 * time.Second):
		t.Fatal("the consumer never reached the gated message")
	}
	amqptest.StopAppWithRestore(t)
	if p := published.Load(); p >= total {
		t.Fatalf("the publisher had finished (%d) before the stop: the run was not interrupted", p)
	}
	release() // the gated effects commit now, with the broker down: their acks are lost
	amqptest.StartApp(t)

	testkit.Eventually(t, 90*time.Second, "every message processed", func() bool {
		select {
		case <-pubDone:
		default:
			return false
		}
		rows, _ := countEffects(t, db)
		return rows >= total
	})

	rows, distinct := countEffects(t, db)
	if rows != total || distinct != total {
		t.Fatalf("effects: %d rows, %d distinct ids; want %d of each", rows, distinct, total)
	}
	if conn.Reconnects() < 1 {
		t.Fatal("the connection never reconnected: the broker restart did not happen during the run")
	}
	if c.Stats().Duplicates < 1 {
		t.Fatalf("stats %+v: the message whose ack was lost must come back as a duplicate", c.Stats())
	}
	t.Logf("published %d (publish errors %d), consumer stats %+v, reconnects %d", published.Load(), publishErrors.Load(), c.Stats(), conn.Reconnects())
}
