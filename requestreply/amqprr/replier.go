package amqprr

import (
	"context"
	"log/slog"
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

// replyOutcome is what the broker said about one reply.
type replyOutcome int

const (
	outcomeConfirmed replyOutcome = iota // confirmed (delivered, or dropped for a direct reply-to consumer that is gone)
	outcomeReturned                      // returned unroutable: the client's queue is gone
	outcomeNacked                        // refused by the broker
	outcomeLost                          // the channel closed before the confirm
)

// replier publishes replies on one channel in confirm mode without waiting
// for their confirms: a dispatcher goroutine matches each confirm (and the
// basic.return that precedes it for an unroutable mandatory reply) and calls
// done with the outcome. At most maxUnconfirmed replies wait for a confirm;
// a publish beyond that waits for room.
type replier struct {
	conn *amqp.Conn
	log  *slog.Logger
	done func(r *sentReply, o replyOutcome)
	room chan struct{}

	mu  sync.Mutex
	cur *replyChan
}

// sentReply identifies one reply for done.
type sentReply struct {
	ID, ReplyTo, Corr string
	IsError           bool
}

type replyChan struct {
	ch     *amqp091.Channel
	sendMu sync.Mutex // seq number + basic.publish

	mu       sync.Mutex
	pending  map[uint64]*sentReply
	returned map[string]struct{} // corr|reply_to of replies returned, until their confirm
	dead     chan struct{}
}

func newReplier(conn *amqp.Conn, log *slog.Logger, maxUnconfirmed int, done func(*sentReply, replyOutcome)) *replier {
	return &replier{conn: conn, log: log, done: done, room: make(chan struct{}, maxUnconfirmed)}
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
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, err
	}
	rc := &replyChan{ch: ch, pending: map[uint64]*sentReply{}, returned: map[string]struct{}{}, dead: make(chan struct{})}
	// Unbuffered returns: the connection's reader hands a return over before
	// it reads the confirm that follows it, and one goroutine takes both.
	returns := ch.NotifyReturn(make(chan amqp091.Return))
	confirms := ch.NotifyPublish(make(chan amqp091.Confirmation, cap(r.room)+16))
	go r.dispatch(rc, returns, confirms)
	r.cur = rc
	return rc, nil
}

// publish sends one reply (mandatory unless to a direct reply-to consumer)
// and returns once it is written; the outcome goes to done later. An error
// means it was not sent.
func (r *replier) publish(ctx context.Context, sr *sentReply, msg amqp091.Publishing) error {
	select {
	case r.room <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	rc, err := r.channel(ctx)
	if err != nil {
		<-r.room
		return err
	}
	rc.sendMu.Lock()
	defer rc.sendMu.Unlock()
	tag := rc.ch.GetNextPublishSeqNo()
	rc.mu.Lock()
	if rc.pending == nil { // dead
		rc.mu.Unlock()
		<-r.room
		return amqp.ErrChannelLost
	}
	rc.pending[tag] = sr
	rc.mu.Unlock()
	if err := rc.ch.PublishWithContext(ctx, "", sr.ReplyTo, !isDirectReplyTo(sr.ReplyTo), false, msg); err != nil {
		rc.mu.Lock()
		_, mine := rc.pending[tag]
		delete(rc.pending, tag)
		rc.mu.Unlock()
		if mine {
			<-r.room
		}
		return err
	}
	return nil
}

func (r *replier) dispatch(rc *replyChan, returns <-chan amqp091.Return, confirms <-chan amqp091.Confirmation) {
	for returns != nil || confirms != nil {
		select {
		case ret, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			rc.mu.Lock()
			rc.returned[ret.CorrelationId+"|"+ret.RoutingKey] = struct{}{}
			rc.mu.Unlock()
		case c, ok := <-confirms:
			if !ok {
				confirms = nil
				continue
			}
			rc.mu.Lock()
			sr := rc.pending[c.DeliveryTag]
			delete(rc.pending, c.DeliveryTag)
			o := outcomeNacked
			if sr != nil && c.Ack {
				o = outcomeConfirmed
				k := sr.Corr + "|" + sr.ReplyTo
				if _, ok := rc.returned[k]; ok {
					delete(rc.returned, k)
					o = outcomeReturned
				}
			}
			rc.mu.Unlock()
			if sr != nil {
				<-r.room
				r.done(sr, o)
			}
		}
	}
	rc.mu.Lock()
	lost := rc.pending
	rc.pending = nil
	close(rc.dead)
	rc.mu.Unlock()
	for range lost {
		<-r.room
	}
	for _, sr := range lost {
		r.done(sr, outcomeLost)
	}
}

// close closes the reply channel; replies not confirmed yet are lost.
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
