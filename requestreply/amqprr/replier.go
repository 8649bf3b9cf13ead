package amqprr

import (
	"context"
	"strings"
	"sync"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/transport/amqp"
)

// DirectReplyTo is RabbitMQ's direct reply-to pseudo-queue. A requester that
// consumes it (no-ack) gets its replies without a queue of its own; the
// reply_to it sends is amq.rabbitmq.reply-to.<token>.
const DirectReplyTo = "amq.rabbitmq.reply-to"

// isDirectReplyTo reports whether replyTo names a direct reply-to consumer.
// RabbitMQ delivers such a reply straight to the consumer's channel while
// routing it and then finds no queue, so with mandatory it returns the reply
// (basic.return NO_ROUTE) although it was delivered; and a reply to a
// consumer that is gone is dropped silently either way. So these replies are
// published without mandatory, and cannot be counted as orphaned.
func isDirectReplyTo(replyTo string) bool { return strings.HasPrefix(replyTo, DirectReplyTo) }

// replier publishes replies on one channel, not in confirm mode: a reply is
// worth something only while its requester waits, and one lost on the way is
// recovered by the requester's retry with the same request id (see Server).
// A mandatory reply that the broker cannot route comes back as basic.return,
// confirms or not; one goroutine per channel takes the returns and calls
// returned.
type replier struct {
	conn     *amqp.Conn
	returned func(amqp091.Return)

	mu  sync.Mutex
	cur *replyChan
}

type replyChan struct {
	ch   *amqp091.Channel
	dead chan struct{} // closed when the channel is gone
}

func newReplier(conn *amqp.Conn, returned func(amqp091.Return)) *replier {
	return &replier{conn: conn, returned: returned}
}

// channel returns the live reply channel, opening one (waiting, within ctx,
// for the Conn to reconnect) if there is none.
func (r *replier) channel(ctx context.Context) (*replyChan, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rc := r.cur; rc != nil {
		select {
		case <-rc.dead:
		default:
			return rc, nil
		}
	}
	ch, err := r.conn.Channel(ctx)
	if err != nil {
		return nil, err
	}
	rc := &replyChan{ch: ch, dead: make(chan struct{})}
	// amqp091-go closes the returns channel when the channel shuts down.
	returns := ch.NotifyReturn(make(chan amqp091.Return, 64))
	go func() {
		for ret := range returns {
			r.returned(ret)
		}
		close(rc.dead)
	}()
	r.cur = rc
	return rc, nil
}

// publish sends one reply (mandatory unless to a direct reply-to consumer)
// and returns once it is written to the connection. An error means it was
// not sent.
func (r *replier) publish(ctx context.Context, replyTo string, msg amqp091.Publishing) error {
	rc, err := r.channel(ctx)
	if err != nil {
		return err
	}
	err = rc.ch.PublishWithContext(ctx, "", replyTo, !isDirectReplyTo(replyTo), false, msg)
	if err != nil && rc.ch.IsClosed() {
		r.mu.Lock()
		if r.cur == rc {
			r.cur = nil // the next publish opens another
		}
		r.mu.Unlock()
	}
	return err
}

// close closes the reply channel.
func (r *replier) close() {
	r.mu.Lock()
	rc := r.cur
	r.cur = nil
	r.mu.Unlock()
	if rc != nil {
		_ = rc.ch.Close()
		<-rc.dead
	}
}
