package amqpdlq

import (
	"context"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/amqp"
)

// A RabbitMQ dead letter whose only time is an out-of-range AMQP timestamp
// (unix -10^12, no mort_en, no x-death) used to fail every sync of its
// queue with SQLSTATE 22008, and the letters behind it were never indexed.
// It is indexed with its time unknown, the next letter with it, the queue
// is drained, and a second sync indexes nothing twice.
func TestAMQPOutOfRangeTimestampIsIndexedAsUnknown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r := setupRabbit(t)
	conn, err := amqp091.Dial(amqptest.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.PublishWithContext(ctx, "", contract.DLQName(r.queue), false, false, amqp091.Publishing{
		Body: []byte(`{}`), Timestamp: time.Unix(-1e12, 0),
		Headers: amqp091.Table{"motiu": "permanent: esquema: x", amqp.HeaderOriginQueue: r.queue}}); err != nil {
		t.Fatal(err)
	}
	good := time.Now().Truncate(time.Microsecond)
	r.exhausted(t, "00000000-0000-4000-8000-000000000001", good)
	testkit.Eventually(t, 10*time.Second, "2 letters on the DLQ", func() bool { return r.onBroker(t) == 2 })

	b := r.backend(t, 0)
	res, err := b.Sync(ctx, r.store)
	if err != nil || len(res.New) != 2 {
		t.Fatalf("sync: %d new, %v; want 2 and no error", len(res.New), err)
	}
	if _, err := b.Sync(ctx, r.store); err != nil {
		t.Fatalf("second sync: %v", err)
	}
	ls, err := r.store.List(ctx, dlq.Filter{})
	if err != nil || len(ls) != 2 || r.onBroker(t) != 0 {
		t.Fatalf("index: %d letters, %v; %d left on the broker; want 2 and 0", len(ls), err, r.onBroker(t))
	}
	bad, ok := ls[1], ls[0] // unknown times sort last
	if !bad.TimeUnknown || !bad.DeadAt.IsZero() || ok.TimeUnknown || !ok.DeadAt.Equal(good) {
		t.Fatalf("bad letter: unknown %v at %v; good letter: unknown %v at %v (want %v)",
			bad.TimeUnknown, bad.DeadAt, ok.TimeUnknown, ok.DeadAt, good)
	}
	since, err := r.store.List(ctx, dlq.Filter{Since: good.Add(-time.Hour)})
	if err != nil || len(since) != 1 || since[0].ID != ok.ID {
		t.Fatalf("--since an hour ago: %d letters, %v; want only the good one", len(since), err)
	}
}
