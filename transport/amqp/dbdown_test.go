package amqp_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
)

// Failure point: the consumer's database refuses connections (a restart)
// while a message is being delivered. The delivery is retried in place,
// unacked, for longer than its MaxAttempts' worth of backoff, and never
// reaches the DLQ; once the database is back the effect is applied once.
func TestDatabaseOutageNeverDeadLettersAHealthyMessage(t *testing.T) {
	b := setup(t)
	var down atomic.Bool
	var refused atomic.Int64
	down.Store(true)
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 2
	cfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		if down.Load() {
			refused.Add(1)
			return errors.New("connection refused (simulated restart)")
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cc := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return recordEffect(ctx, tx, m, 0)
	})
	cc.Pool, cc.MaxAttempts = pool, 3
	c, _ := startConsumer(t, cc)
	publish(t, b, event(t, b.queue, "k", 1))
	// 6 refused connections: past the 3 attempts' backoff (100 + 200 ms) the
	// old code dead-lettered the message after.
	waitFor(t, 30*time.Second, "6 refused connections", func() bool { return refused.Load() >= 6 })
	dlq := newTestDLQ(t, b.conn, b.queue)
	if n, _ := dlq.Count(context.Background()); n != 0 {
		t.Fatalf("%d message(s) dead-lettered during the outage", n)
	}
	down.Store(false)
	waitFor(t, 30*time.Second, "the effect after the outage", func() bool { n, _ := countEffects(t, b.db); return n == 1 })
	if st := c.Stats(); st.DeadLettered != 0 || st.Retried != 0 || st.Processed != 1 {
		t.Fatalf("stats %+v, want 1 processed, 0 retried, 0 dead-lettered", st)
	}
	if n, _ := dlq.Count(context.Background()); n != 0 {
		t.Fatalf("%d message(s) in the DLQ", n)
	}
}
