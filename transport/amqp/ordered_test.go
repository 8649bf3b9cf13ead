package amqp_test

import (
	"context"
	"fmt"
	"slices"
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
	r, err := b.pool.Query(ctx, `SELECT clau, array_agg(seq ORDER BY n), array_agg(DISTINCT instancia) FROM efectes GROUP BY clau`)
	if err != nil {
		t.Fatal(err)
	}
	type keyRow struct {
		Key   string
		Seqs  []int32
		Insts []int32
	}
	got, err := pgx.CollectRows(r, pgx.RowToStructByPos[keyRow])
	if err != nil {
		t.Fatal(err)
	}
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
			t.Fatalf("key %s processed in order %v", k.Key, k.Seqs)
		}
		for _, inst := range k.Insts {
			active[inst] = true
		}
	}
	if len(active) != instances {
		t.Fatalf("instances that processed messages: %v; want all %d (shards spread over instances)", active, instances)
	}
}
