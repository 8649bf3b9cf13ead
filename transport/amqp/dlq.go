package amqp

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/transport"
)

// DeadLetter is one message of a DLQ, as the DLQ operations show it.
type DeadLetter struct {
	DLQ       string // the queue it is in, <queue>.dlq
	Origin    string // the queue it died in: where Replay sends it
	MessageID string // AMQP message_id (km0 sets it to id_esdeveniment)
	EventID   string // header id_esdeveniment
	Type      string // header tipus
	// Reason is the motiu header for a dead letter km0 published (exhausted
	// retries), or, for a native one, "permanent: rejected by <queue>" built
	// from x-death (the handler's error text is in the consumer's log).
	Reason   string
	Attempts int       // header intents (0 when absent)
	DeadAt   time.Time // header mort_en, else x-death time; zero if unknown
	Headers  amqp.Table
	Body     []byte
}

// DLQFilter selects dead letters. Zero fields select everything.
type DLQFilter struct {
	IDs    []string  // id_esdeveniment or message_id
	Reason string    // prefix of Reason, e.g. "permanent", "transitori esgotat", "esquema"
	Since  time.Time // DeadAt >= Since
	Until  time.Time // DeadAt < Until
	Limit  int       // at most this many (0: no limit)
}

// Match reports whether dl passes f (Limit aside).
func (f DLQFilter) Match(dl *DeadLetter) bool {
	if len(f.IDs) > 0 && !slices.Contains(f.IDs, dl.EventID) && !slices.Contains(f.IDs, dl.MessageID) {
		return false
	}
	if f.Reason != "" && !strings.HasPrefix(dl.Reason, f.Reason) {
		return false
	}
	if !f.Since.IsZero() && dl.DeadAt.Before(f.Since) {
		return false
	}
	if !f.Until.IsZero() && !dl.DeadAt.Before(f.Until) {
		return false
	}
	return true
}

// ErrNotFound is returned by DLQ.Show for an id that is not in the DLQ.
var ErrNotFound = errors.New("amqp: dead letter not found")

// DLQ operates on the dead-letter queue <queue>.dlq of one work queue
// (in ordered mode, the logical queue: its shards share the DLQ). It reads
// with basic.get and never auto-acks: what it does not remove is requeued
// when its channel closes, in its original position. Operations on one DLQ
// should not run concurrently with each other.
type DLQ struct {
	conn  *Conn
	queue string
	pub   *Publisher
}

// NewDLQ returns the operations on queue's DLQ. queue is the work queue
// ("inventari.comandes"), not the DLQ's name.
func NewDLQ(conn *Conn, queue string) *DLQ {
	return &DLQ{conn: conn, queue: queue, pub: newPublisher(conn, PublisherConfig{})}
}

// Name returns the DLQ's name.
func (q *DLQ) Name() string { return DLQName(q.queue) }

// Count returns how many messages the DLQ holds (an error if it does not exist).
func (q *DLQ) Count(ctx context.Context) (int, error) {
	var n int
	err := q.conn.Do(ctx, func(ch *amqp.Channel) error {
		info, err := ch.QueueDeclarePassive(q.Name(), true, false, false, false, nil)
		n = info.Messages
		return err
	})
	return n, err
}

// List returns the dead letters that pass f, oldest first, leaving them all
// in the DLQ.
func (q *DLQ) List(ctx context.Context, f DLQFilter) ([]DeadLetter, error) {
	var out []DeadLetter
	err := q.scan(ctx, func(dl *DeadLetter, _ *amqp.Delivery) (bool, error) {
		if f.Match(dl) && (f.Limit <= 0 || len(out) < f.Limit) {
			out = append(out, *dl)
		}
		return false, nil
	})
	return out, err
}

// Show returns the dead letter whose id_esdeveniment or message_id is id, or
// ErrNotFound. It stays in the DLQ.
func (q *DLQ) Show(ctx context.Context, id string) (*DeadLetter, error) {
	got, err := q.List(ctx, DLQFilter{IDs: []string{id}, Limit: 1})
	if err != nil {
		return nil, err
	}
	if len(got) == 0 {
		return nil, fmt.Errorf("%w: %s in %s", ErrNotFound, id, q.Name())
	}
	return &got[0], nil
}

// Replay republishes each dead letter that passes f to the queue it died in
// (default exchange, routing key = that queue; mandatory and confirmed) with
// the same body, message_id and id_esdeveniment, and with intents, motiu and
// the other failure headers removed so it gets all its attempts again. Only
// after the confirm is it removed from the DLQ; so a crash in between leaves
// it in both places, and the consumer's inbox absorbs the duplicate.
// dryRun counts without changing anything. It returns how many were (or
// would be) replayed.
func (q *DLQ) Replay(ctx context.Context, f DLQFilter, dryRun bool) (int, error) {
	n := 0
	err := q.scan(ctx, func(dl *DeadLetter, d *amqp.Delivery) (bool, error) {
		if !f.Match(dl) || (f.Limit > 0 && n >= f.Limit) {
			return false, nil
		}
		n++
		if dryRun {
			return false, nil
		}
		h := copyHeaders(d.Headers, transport.HeaderAttempts, transport.HeaderReason, transport.HeaderLastError,
			transport.HeaderNotBefore, HeaderOriginQueue, HeaderDeadAt, HeaderFirstFailure)
		if err := q.pub.PublishRaw(ctx, "", dl.Origin, republish(d, h)); err != nil {
			n--
			return false, fmt.Errorf("amqp: replay %s to %s: %w", dl.MessageID, dl.Origin, err)
		}
		return true, nil
	})
	return n, err
}

// Purge deletes the dead letters that pass f and returns how many it deleted.
func (q *DLQ) Purge(ctx context.Context, f DLQFilter) (int, error) {
	n := 0
	err := q.scan(ctx, func(dl *DeadLetter, _ *amqp.Delivery) (bool, error) {
		if !f.Match(dl) || (f.Limit > 0 && n >= f.Limit) {
			return false, nil
		}
		n++
		return true, nil
	})
	return n, err
}

// scan gets every message the DLQ held when it started, calls fn for each,
// acks those fn says to remove, and requeues the rest by closing the channel.
func (q *DLQ) scan(ctx context.Context, fn func(dl *DeadLetter, d *amqp.Delivery) (remove bool, err error)) error {
	defer q.pub.Close() //nolint:errcheck // best effort
	return q.conn.Do(ctx, func(ch *amqp.Channel) error {
		info, err := ch.QueueDeclarePassive(q.Name(), true, false, false, false, nil)
		if err != nil {
			return fmt.Errorf("amqp: DLQ %s: %w", q.Name(), err)
		}
		for i := 0; i < info.Messages; i++ {
			if err := ctx.Err(); err != nil {
				return err
			}
			d, ok, err := ch.Get(q.Name(), false)
			if err != nil {
				return fmt.Errorf("amqp: DLQ %s: get: %w", q.Name(), err)
			}
			if !ok {
				return nil
			}
			remove, err := fn(q.deadLetter(&d), &d)
			if err != nil {
				return err
			}
			if remove {
				if err := d.Ack(false); err != nil {
					return fmt.Errorf("amqp: DLQ %s: ack: %w", q.Name(), err)
				}
			}
		}
		return nil
	})
}

func (q *DLQ) deadLetter(d *amqp.Delivery) *DeadLetter {
	dl := &DeadLetter{DLQ: q.Name(), MessageID: d.MessageId, Type: d.Type, Headers: d.Headers, Body: d.Body,
		Attempts: int(headerInt(d.Headers, transport.HeaderAttempts))}
	_, ownCopy := d.Headers[transport.HeaderReason]
	dl.EventID, _ = d.Headers[transport.HeaderEventID].(string)
	if t, ok := d.Headers[transport.HeaderType].(string); ok {
		dl.Type = t
	}
	dl.Reason, _ = d.Headers[transport.HeaderReason].(string)
	dl.Origin, _ = d.Headers[HeaderOriginQueue].(string)
	dl.DeadAt, _ = headerTime(d.Headers, HeaderDeadAt)
	if deaths := XDeaths(d.Headers); len(deaths) > 0 {
		last := deaths[0]
		if dl.Origin == "" {
			dl.Origin = last.Queue
		}
		if !ownCopy {
			// intents counts the attempts before the one that was rejected.
			dl.Attempts++
			if last.Reason == "rejected" {
				dl.Reason = "permanent: rejected by " + last.Queue
			} else {
				dl.Reason = "x-death: " + last.Reason + " in " + last.Queue
			}
		}
		if dl.DeadAt.IsZero() {
			dl.DeadAt = last.Time
		}
	}
	if dl.Origin == "" {
		dl.Origin = q.queue
	}
	return dl
}
