package amqp_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// Ordered mode. 4 consumer instances (each its own connection)
// share 4 shard queues with x-single-active-consumer; 10,000 messages over
// 200 keys are published interleaved. Each instance becomes the active
// consumer of one shard, and halfway through instance 0 stops, so its shard
// fails over to a standby instance (its unacked deliveries are requeued in
// place). The order per key holds for all 200 keys, and the effect count is
// 10,000. With competing consumers on one queue instead, the order check
// fails (tried by hand: Shards 1, Workers 4).
func TestOrderedModeKeepsOrderPerKeyAcrossInstancesAndFailover(t *testing.T) {
	const instances, keys, perKey = 4, 200, 50
	b := setup(t)
	ctx := context.Background()
	stops := make([]func(), instances)
	consumers := make([]*testConsumer, instances)
	for i := range instances {
		conn := b.conn
		if i > 0 {
			conn = amqptest.Dial(t)
		}
		cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return recordEffect(ctx, tx, m, i)
		})
		cfg.Conn, cfg.Shards, cfg.Instance, cfg.Instances, cfg.StandbyDelay, cfg.Prefetch = conn, 4, i, instances, time.Second, 50
		consumers[i], stops[i] = startConsumer(t, cfg)
	}
	t.Cleanup(func() { // stop every instance before any queue is deleted
		for _, stop := range stops {
			stop()
		}
	})
	pub, err := amqp.NewPublisher(ctx, b.conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	sp := amqp.ShardedPublisher{Next: pub, Shards: 4}
	var batch []*transport.Message
	for seq := range perKey {
		for k := range keys {
			batch = append(batch, event(t, b.queue, fmt.Sprintf("P-2026-%06d", k), seq))
			if len(batch) == 500 {
				if err := sp.Publish(ctx, batch); err != nil {
					t.Fatal(err)
				}
				batch = batch[:0]
			}
		}
		if seq == perKey/2 {
			testkit.Eventually(t, 60*time.Second, "instance 0 to process some messages", func() bool {
				return consumers[0].Stats().Processed > 0
			})

			stops[0]() // instance 0 leaves: its shard fails over
		}
	}
	testkit.Eventually(t, 90*time.Second, "10,000 effects", func() bool { n, _ := countEffects(t, b.db); return n >= keys*perKey })

	rows, distinct := countEffects(t, b.db)
	if rows != keys*perKey || distinct != keys*perKey {
		t.Fatalf("effects: %d rows, %d distinct; want %d", rows, distinct, keys*perKey)
	}
	got := effectsByKey(t, b)
	if len(got) != keys {
		t.Fatalf("%d keys processed, want %d", len(got), keys)
	}
	want := make([]int32, perKey)
	for i := range want {
		want[i] = int32(i)
	}
	active := map[int32]bool{}
	for _, k := range got {
		if !slices.Equal(k.Seqs, want) {
			t.Fatalf("key %s processed in order %v by instances %v", k.Key, k.Seqs, k.By)
		}
		for _, inst := range k.By {
			active[inst] = true
		}
	}
	if len(active) != instances {
		t.Fatalf("instances that processed messages: %v; want all %d (shards spread over instances)", active, instances)
	}
}

// Ordered mode, an instance leaving while a new standby arrives: instance
// 0 is the only consumer of its shard and is stopped while its handler is
// held inside a batch, with more deliveries pushed to its channel behind
// it; instance 1 then subscribes to the shard (a standby that starts while
// the other leaves, as in a rolling restart). Only when instance 1 had a
// second to take messages is the handler let go. The leaving instance must
// stay the shard's active consumer until its channel closed (and the broker
// requeued what it held, in place): every key is applied in order. With a
// basic.cancel at the stop (before the fix), the queue made instance 1
// active at once and it applied later events of the held keys first.
func TestOrderedModeLeavingInstanceIsNotOvertakenByAStandbyArriving(t *testing.T) {
	t.Parallel()
	const shards, keys, perKey = 2, 20, 20
	b := setup(t)
	ctx := context.Background()
	held, release := make(chan struct{}), make(chan struct{})
	var holdOnce sync.Once
	config := func(i int, conn *amqp.Conn) consumerConfig {
		cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if i == 0 {
				holdOnce.Do(func() { close(held); <-release })
			}
			return recordEffect(ctx, tx, m, i)
		})
		cfg.Conn, cfg.Shards, cfg.Instance, cfg.Instances, cfg.StandbyDelay, cfg.Prefetch = conn, shards, i, 2, 10*time.Millisecond, 50
		cfg.ShutdownTimeout = time.Minute
		return cfg
	}
	pub, err := amqp.NewPublisher(ctx, b.conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var batch []*transport.Message
	for seq := range perKey {
		for k := range keys {
			batch = append(batch, event(t, b.queue, fmt.Sprintf("P-2026-%06d", k), seq))
		}
	}
	// The topology first (the source declares it), then the messages, then
	// instance 0 alone.
	_, stopFirst := startConsumer(t, config(0, b.conn))
	if err := (amqp.ShardedPublisher{Next: pub, Shards: shards}).Publish(ctx, batch); err != nil {
		t.Fatal(err)
	}
	select {
	case <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("instance 0 took no message")
	}
	stopped := make(chan struct{})
	go func() { stopFirst(); close(stopped) }()
	// Windows for the wrong thing to happen (nothing to wait for when it
	// does not): the stop under way, then instance 1's chance to overtake.
	time.Sleep(200 * time.Millisecond)
	_, _ = startConsumer(t, config(1, amqptest.Dial(t)))
	time.Sleep(time.Second)
	close(release)
	<-stopped
	testkit.Eventually(t, 60*time.Second, "every effect", func() bool { n, _ := countEffects(t, b.db); return n >= keys*perKey })
	rows, distinct := countEffects(t, b.db)
	if rows != keys*perKey || distinct != keys*perKey {
		t.Fatalf("effects: %d rows, %d distinct; want %d", rows, distinct, keys*perKey)
	}
	bad := 0
	for _, k := range effectsByKey(t, b) {
		if !slices.IsSorted(k.Seqs) {
			if bad == 0 {
				t.Errorf("key %s processed in order %v by instances %v", k.Key, k.Seqs, k.By)
			}
			bad++
		}
	}
	if bad > 0 {
		t.Fatalf("%d of %d keys out of order", bad, keys)
	}
}

// keyEffects are the effects of one key, in the order they were applied.
type keyEffects struct {
	Key  string
	Seqs []int32 // the events' seq
	By   []int32 // the instance that applied each
}

// effectsByKey reads the efectes table by key, in key order.
func effectsByKey(t *testing.T, b *bundle) []keyEffects {
	t.Helper()
	r, err := b.pool.Query(context.Background(), `SELECT clau, array_agg(seq ORDER BY n), array_agg(instancia ORDER BY n) FROM efectes GROUP BY clau ORDER BY clau`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(r, pgx.RowToStructByPos[keyEffects])
	if err != nil {
		t.Fatal(err)
	}
	return got
}
