package cdc_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

type bigPayload struct {
	Seq int    `json:"seq"`
	Pad string `json:"pad"`
}

// refusing wraps a publisher and refuses for good (*transport.RejectedError)
// every record whose value contains mark while refuse is set, confirming
// the others of the call.
type refusing struct {
	next   transport.Publisher
	mark   string
	refuse atomic.Bool
}

func (p *refusing) Publish(ctx context.Context, msgs []*transport.Message) error {
	var rej transport.RejectedError
	var pass []*transport.Message
	for i, m := range msgs {
		if p.refuse.Load() && strings.Contains(string(m.Value), p.mark) {
			rej.Index = append(rej.Index, i)
			rej.Errs = append(rej.Errs, errors.New("MESSAGE_TOO_LARGE (test broker)"))
			continue
		}
		pass = append(pass, m)
	}
	if err := p.next.Publish(ctx, pass); err != nil {
		return err
	}
	if len(rej.Index) > 0 {
		return &rej
	}
	return nil
}

// A row the broker refuses for good is parked, as by the polling relay; the
// later events of its aggregate stay pending behind it while other
// aggregates flow; once the broker accepts it and an operator releases it,
// the relay publishes it and the rows behind it, in order, and the stream
// goes on.
func TestRowRefusedByTheBrokerIsParkedAndItsAggregateWaitsUntilReleased(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pub := &refusing{next: b.pub, mark: "refuse-me"}
	pub.refuse.Store(true)
	cfg := b.config()
	cfg.Publisher = pub
	r := newRelay(t, cfg)
	start(t, r)
	testkit.Eventually(t, 10*time.Second, "the relay to hold the slot", r.Active)
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 1})
	x2 := b.enqueue(t, "X", bigPayload{Seq: 2, Pad: "refuse-me"})
	testkit.Eventually(t, 10*time.Second, "X1 published, X2 parked", func() bool {
		return b.pending(t) == 1 && b.count(t, "SELECT count(*) FROM outbox_aparcats") == 1
	})

	// Written after X2 was refused: not in the Publish that refused it (a
	// later row of the aggregate in that very Publish was confirmed by the
	// broker, as with the polling relay's chunks).
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 3})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 1})
	testkit.Eventually(t, 10*time.Second, "Y1 published, X3 behind X2", func() bool { return b.pending(t) == 2 })
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 4})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 2})
	testkit.Eventually(t, 10*time.Second, "Y2 published while X waits", func() bool { return b.pending(t) == 3 })
	parked, err := relay.Parked(ctx, b.s.Pool, b.s.Names())
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].ID != x2 || parked[0].Waiting != 2 || !strings.Contains(parked[0].Reason, "MESSAGE_TOO_LARGE") {
		t.Fatalf("parked: %+v", parked)
	}
	pub.refuse.Store(false) // the operator fixes the broker
	if err := relay.Release(ctx, b.s.Pool, b.s.Names(), x2); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "X2..X4 published after the release", func() bool { return b.pending(t) == 0 })
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 5})
	testkit.Eventually(t, 10*time.Second, "X5 published", func() bool { return b.pending(t) == 0 })
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, 7))
	if len(copies) != 7 {
		t.Fatalf("%d distinct ids, want 7", len(copies))
	}
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"X": 5, "Y": 2})
}

// Over RabbitMQ: a tipus over 255 bytes cannot travel as an AMQP type; the
// publisher's Checker refuses it before sending, the row is parked, the row
// behind it in its aggregate waits, and the others reach the queue.
func TestRabbitMQPublisherParksWhatAMQPCannotCarry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.cdc")
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
	r := newRelay(t, cfg)
	start(t, r)
	testkit.Eventually(t, 10*time.Second, "the relay to hold the slot", r.Active)
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 1})
	long := &outbox.Event{Aggregate: "comanda", AggregateID: "X", Type: strings.Repeat("t", 300), Payload: relaytest.SeqPayload{Seq: 2}}
	if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.Enqueue(ctx, tx, long) }); err != nil {
		t.Fatal(err)
	}
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 3})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 1})
	testkit.Eventually(t, 10*time.Second, "X1 and Y1 in the queue", func() bool { return amqptest.QueueLen(t, conn, queue) == 2 })
	testkit.Eventually(t, 10*time.Second, "X2 parked, X3 behind it", func() bool { return b.pending(t) == 2 })
	parked, err := relay.Parked(ctx, b.s.Pool, b.s.Names())
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].AggregateID != "X" || !strings.Contains(parked[0].Reason, "type of 300 bytes") {
		t.Fatalf("parked: %+v", parked)
	}
	if n := conn.Reconnects(); n != 0 {
		t.Fatalf("%d reconnection(s), want 0", n)
	}
}
