package relay_test

import (
	"context"
	"errors"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/transport/amqp"
)

// CONTRACT 4 on RabbitMQ. Failure point: the broker nacks publishes (its
// queue is full: x-max-length 1, x-overflow reject-publish). A nacked record
// is not confirmed, so no row of the batch is marked: 3 stay pending although
// the broker took the first. Once the queue has room, the relay publishes all
// 3 (the first again, with the same id_esdeveniment).
func TestRowsNackedByRabbitMQStayPending(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.relay")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue} })
	declare := func(args amqp091.Table) {
		t.Helper()
		if err := conn.Do(ctx, func(ch *amqp091.Channel) error {
			if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
				return err
			}
			_, err := ch.QueueDeclare(queue, true, false, false, false, args)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	queueLen := func() int { t.Helper(); return amqptest.QueueLen(t, conn, queue) }
	declare(amqp091.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := b.config()
	cfg.Publisher, cfg.Topic = pub, queue
	r := b.newRelay(t, cfg)
	for seq := 1; seq <= 3; seq++ {
		b.enqueue(t, "X", relaytest.SeqPayload{Seq: seq})
	}
	n, err := r.RunOnce(ctx)
	if !errors.Is(err, amqp.ErrNacked) {
		t.Fatalf("RunOnce: published %d, err %v; want ErrNacked", n, err)
	}
	if p, q := b.pending(t), queueLen(); n != 0 || p != 3 || q != 1 {
		t.Fatalf("published %d, %d pending, queue holds %d; want 0, 3, 1", n, p, q)
	}
	declare(nil)
	if n := b.drainOnce(t, r); n != 3 {
		t.Fatalf("published %d after the queue has room, want 3", n)
	}
	if p, q := b.pending(t), queueLen(); p != 0 || q != 3 {
		t.Fatalf("%d pending, queue holds %d; want 0 and 3", p, q)
	}
}
