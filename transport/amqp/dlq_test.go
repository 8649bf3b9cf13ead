package amqp_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// The DLQ operations: list and show leave the messages in place; replay
// (after the handler is fixed) brings them back with the same
// id_esdeveniment and they are processed; purge deletes by filter.
func TestDLQListShowReplayPurge(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var fixed atomic.Bool
	cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		switch {
		case strings.HasPrefix(string(m.Key), "esquema") && !fixed.Load():
			return outcome.Permanentf("esquema: falta adreca_lliurament")
		case string(m.Key) == "mapes":
			return errors.New("mapes: 503")
		}
		return recordEffect(ctx, tx, m, 0)
	})
	cfg.MaxAttempts = 2
	startConsumer(t, cfg)
	bad1, bad2, slow := event(t, b.queue, "esquema-1", 1), event(t, b.queue, "esquema-2", 2), event(t, b.queue, "mapes", 3)
	publish(t, b, bad1, bad2, slow)
	dlq := amqp.NewDLQ(b.conn, b.queue)
	waitFor(t, 20*time.Second, "3 dead letters", func() bool { n, _ := dlq.Count(ctx); return n == 3 })

	all, err := dlq.List(ctx, amqp.DLQFilter{})
	if err != nil || len(all) != 3 {
		t.Fatalf("list: %d, %v", len(all), err)
	}
	for _, dl := range all {
		if dl.DeadAt.IsZero() || dl.Origin != b.queue || dl.EventID == "" || dl.Type != "prova.feta" {
			t.Fatalf("dead letter lacks data: %+v", dl)
		}
	}
	transient, err := dlq.List(ctx, amqp.DLQFilter{Reason: "transitori esgotat"})
	if err != nil || len(transient) != 1 || transient[0].Attempts != 2 || transient[0].Reason != "transitori esgotat: mapes: 503" {
		t.Fatalf("filtered list: %+v, %v", transient, err)
	}
	id1, _ := bad1.Header(transport.HeaderEventID)
	dl, err := dlq.Show(ctx, id1)
	if err != nil || dl.EventID != id1 || string(dl.Body) != string(bad1.Value) {
		t.Fatalf("show: %+v, %v", dl, err)
	}
	if _, err := dlq.Show(ctx, "no-such-id"); !errors.Is(err, amqp.ErrNotFound) {
		t.Fatalf("show of a missing id: %v", err)
	}
	if n, err := dlq.Replay(ctx, amqp.DLQFilter{Reason: "permanent"}, true); err != nil || n != 2 {
		t.Fatalf("dry run: %d, %v", n, err)
	}
	if n, _ := dlq.Count(ctx); n != 3 {
		t.Fatalf("list, show and a dry run must leave the DLQ as it was: %d messages", n)
	}

	fixed.Store(true)
	if n, err := dlq.Replay(ctx, amqp.DLQFilter{Reason: "permanent"}, false); err != nil || n != 2 {
		t.Fatalf("replay: %d, %v", n, err)
	}
	waitFor(t, 10*time.Second, "2 effects after the replay", func() bool { n, _ := countEffects(t, b.db); return n == 2 })
	rows, err := b.pool.Query(ctx, `SELECT id FROM efectes ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	id2, _ := bad2.Header(transport.HeaderEventID)
	want := []string{id1, id2}
	slices.Sort(want)
	if !slices.Equal(ids, want) {
		t.Fatalf("effects for ids %v, want the original ids %v", ids, want)
	}
	if n, _ := dlq.Count(ctx); n != 1 {
		t.Fatalf("after replay the DLQ holds %d, want 1", n)
	}
	if n, err := dlq.Purge(ctx, amqp.DLQFilter{Reason: "transitori"}); err != nil || n != 1 {
		t.Fatalf("purge: %d, %v", n, err)
	}
	if n, _ := dlq.Count(ctx); n != 0 {
		t.Fatalf("after purge the DLQ holds %d", n)
	}
}
