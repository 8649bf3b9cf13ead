package relay_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport/amqp"
)

// A tipus over 255 bytes cannot travel as an AMQP type (a short string).
// Over RabbitMQ its row is parked before anything is sent, and the other
// rows go out on the same connection: the publisher used to hand it to
// amqp091-go, which dropped the whole connection, at every retry, for ever.
// The relay asks the publisher (transport.Checker) while building the chunk,
// so X3, in the same chunk, is held behind X2 instead of overtaking it.
func TestRowWithATipusTooLongForAMQPIsParked(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.relay")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue} })
	if err := conn.Declare(ctx, amqp.Topology{Queues: []amqp.Queue{{Name: queue, Durable: true}}}); err != nil {
		t.Fatal(err)
	}
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := b.config()
	cfg.Publisher, cfg.Topic = pub, queue
	r := b.newRelay(t, cfg)

	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 1})
	long := &outbox.Event{Aggregate: "comanda", AggregateID: "X", Type: strings.Repeat("t", 300), Payload: relaytest.SeqPayload{Seq: 2}}
	if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.Enqueue(ctx, tx, long) }); err != nil {
		t.Fatal(err)
	}
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 3}) // same chunk: must not overtake X2
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 1})
	if n := b.drainOnce(t, r); n != 2 {
		t.Fatalf("published %d, want 2 (X1, Y1; X3 waits behind the parked X2)", n)
	}
	parked, err := relay.Parked(ctx, b.s.Pool, b.s.Names())
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].AggregateID != "X" || !strings.Contains(parked[0].Reason, "type of 300 bytes") {
		t.Fatalf("parked: %+v", parked)
	}
	if p := b.pending(t); p != 2 {
		t.Fatalf("%d pending, want 2 (X2 parked, X3 behind it)", p)
	}
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 2})
	if n := b.drainOnce(t, r); n != 1 {
		t.Fatalf("published %d, want 1 (Y2; X3 waits behind the parked X2)", n)
	}
	n := amqptest.QueueLen(t, conn, queue)
	if n != 3 || conn.Reconnects() != 0 {
		t.Fatalf("queue holds %d (want 3), %d reconnection(s) (want 0)", n, conn.Reconnects())
	}
}
