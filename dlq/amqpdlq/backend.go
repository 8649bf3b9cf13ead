// Package amqpdlq is the RabbitMQ Backend of package dlq: the queues
// <queue>.dlq of CONTRACT.md, indexed into a dlq.Store that takes custody
// of the letters, and replays to the work queues.
package amqpdlq

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// BatchDefault is how many messages of a RabbitMQ DLQ one index
// transaction takes.
const BatchDefault = 500

// Config configures a Backend.
type Config struct {
	// Conn is the RabbitMQ connection; the caller closes it. Required.
	Conn *amqp.Conn
	// Queues are the work queues (in ordered mode the logical queue) whose
	// <queue>.dlq are indexed; a name already ending in ".dlq" is taken as
	// the DLQ itself. At least one is required.
	Queues []string
	// SyncTimeout bounds one Sync. Default 30 s.
	SyncTimeout time.Duration
	// Batch is how many messages one index transaction takes. Default 500.
	Batch int
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// Backend is the dlq.Backend of the RabbitMQ queues <queue>.dlq of
// CONTRACT.md. Reading a RabbitMQ queue is destructive, so the index takes
// custody: Sync gets the messages of each DLQ (basic.get, manual ack),
// indexes them in one transaction per batch and acks them off the broker only
// after that transaction committed. From then on the letter lives in the
// PostgreSQL index (bytes and headers exactly, x-death rendered as text);
// ls, show and purge work on the index, and replay republishes from it. A
// failed or cancelled Sync leaves what it had not indexed on the broker: the
// channel closes and RabbitMQ requeues it.
//
// Letter IDs are "<dlq queue>/0/<n>", n a sequence per DLQ queue taken from
// the index under a transaction-level advisory lock, so they are stable and
// two Syncs at once never give one ID to two letters. If the index commits
// and the ack is lost (a crash or a dropped connection in between), RabbitMQ
// redelivers the messages; Sync recognises a redelivered message already
// indexed (same DLQ, time of death, value and headers) and acks it without
// indexing it again.
//
// Do not share a DLQ queue name with a Kafka DLQ topic in one index schema:
// their IDs would overlap.
type Backend struct {
	cfg Config
	pub *amqp.Publisher
	// afterCommit, when set (tests), runs between the index commit and the
	// ack; an error stops Sync there, as a crash would.
	afterCommit func() error
}

var _ dlq.QueueBackend = (*Backend)(nil)

// New returns a Backend. It fails without a Conn or without
// queues; the DLQ queues are first looked up by Sync, which fails for one
// that does not exist.
func New(cfg Config) (*Backend, error) {
	if cfg.Conn == nil {
		return nil, errors.New("amqpdlq: Config needs Conn")
	}
	var queues []string
	for _, q := range cfg.Queues {
		q = strings.TrimSuffix(strings.TrimSpace(q), contract.DLQSuffix)
		if q != "" && !slices.Contains(queues, q) {
			queues = append(queues, q)
		}
	}
	if len(queues) == 0 {
		return nil, errors.New("amqpdlq: Config needs at least one queue")
	}
	cfg.Queues = queues
	cfg.SyncTimeout = cmp.Or(cfg.SyncTimeout, dlq.SyncTimeoutDefault)
	cfg.Batch = cmp.Or(cfg.Batch, BatchDefault)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	pub, err := amqp.NewPublisher(context.Background(), cfg.Conn, amqp.PublisherConfig{Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	return &Backend{cfg: cfg, pub: pub}, nil
}

// Close closes the publisher's channel (not the Conn).
func (b *Backend) Close() error { return b.pub.Close() }

// Sync implements dlq.Backend: for each DLQ it takes at most the messages the
// queue held when it started, batch by batch (see Backend). It fails for
// a DLQ queue that does not exist, naming it; what it indexed stays indexed
// and acked.
func (b *Backend) Sync(ctx context.Context, s *dlq.Store) (dlq.SyncResult, error) {
	var res dlq.SyncResult
	ctx, cancel := context.WithTimeout(ctx, b.cfg.SyncTimeout)
	defer cancel()
	for _, q := range b.cfg.Queues {
		if err := b.syncQueue(ctx, s, q, &res); err != nil {
			return res, err
		}
	}
	return res, nil
}

func (b *Backend) syncQueue(ctx context.Context, s *dlq.Store, queue string, res *dlq.SyncResult) error {
	name := contract.DLQName(queue)
	return b.cfg.Conn.Do(ctx, func(ch *amqp091.Channel) error {
		info, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		if err != nil {
			return fmt.Errorf("dlq: RabbitMQ DLQ %s: %w", name, err)
		}
		for left := info.Messages; left > 0; {
			var batch []amqp091.Delivery
			for len(batch) < min(left, b.cfg.Batch) {
				if err := ctx.Err(); err != nil {
					return fmt.Errorf("dlq: sync of %s stopped (%d left on the broker): %w", name, left, err)
				}
				d, ok, err := ch.Get(name, false)
				if err != nil {
					return fmt.Errorf("dlq: RabbitMQ DLQ %s: get: %w", name, err)
				}
				if !ok {
					left = len(batch) // the queue is empty: this batch is the last
					break
				}
				batch = append(batch, d)
			}
			if len(batch) == 0 {
				return nil
			}
			left -= len(batch)
			added, refused, err := s.IndexQueued(ctx, name, lettersOfDeliveries(queue, batch))
			if err != nil {
				return err // nothing acked: the channel closes and RabbitMQ requeues the batch
			}
			res.Read += len(batch)
			res.New = append(res.New, added...)
			res.Refused = append(res.Refused, refused...)
			if b.afterCommit != nil {
				if err := b.afterCommit(); err != nil {
					return err
				}
			}
			if err := ch.Ack(batch[len(batch)-1].DeliveryTag, true); err != nil {
				return fmt.Errorf("dlq: %s: indexed but not acked (the next sync recognises them): %w", name, err)
			}
		}
		return nil
	})
}

// lettersOfDeliveries converts deliveries of the DLQ of queue (see amqpLetter).
func lettersOfDeliveries(queue string, ds []amqp091.Delivery) []dlq.Queued {
	out := make([]dlq.Queued, len(ds))
	now := time.Now()
	for i := range ds {
		out[i] = dlq.Queued{Letter: amqpLetter(queue, &ds[i], now), Redelivered: ds[i].Redelivered}
	}
	return out
}

// amqpLetter builds the Letter of a delivery from the DLQ of queue, without
// ID. Headers are sorted by key (so a redelivery compares equal); x-death is
// kept as text for show. The time of death is mort_en, else x-death's, else
// the message timestamp, else now.
func amqpLetter(queue string, d *amqp091.Delivery, now time.Time) *dlq.Letter {
	dl := amqp.DeadLetterOf(queue, d)
	m := amqp.FromDelivery(d)
	if deaths := amqp.XDeaths(d.Headers); len(deaths) > 0 {
		parts := make([]string, len(deaths))
		for i, x := range deaths {
			parts[i] = fmt.Sprintf("%s in %s ×%d at %s", x.Reason, x.Queue, x.Count, x.Time.UTC().Format(time.RFC3339))
		}
		m.Headers = append(m.Headers, transport.Header{Key: "x-death", Value: strings.Join(parts, "; ")})
	}
	slices.SortFunc(m.Headers, func(a, b transport.Header) int { return strings.Compare(a.Key, b.Key) })
	deadAt := dl.DeadAt
	if deadAt.IsZero() {
		deadAt = d.Timestamp
	}
	if deadAt.IsZero() {
		deadAt = now
	}
	l := dlq.NewLetter(contract.DLQName(queue), 0, -1, deadAt, m)
	l.OriginalTopic, l.Reason, l.Attempts = dl.Origin, dl.Reason, dl.Attempts
	l.Type = cmp.Or(l.Type, dl.Type)
	return l
}

// Publish implements dlq.Backend: each message goes to the default exchange with
// routing key Topic (the original work queue), mandatory and confirmed, with
// the same value and id_esdeveniment (also the AMQP message_id) and without
// the headers of the dead-lettering (x-*, cua_origen, mort_en, and
// grup_consumidor: the work queue is that consumer's own). Errors are
// amqp.Publisher's: a *amqp.ReturnedError when the queue no longer exists.
func (b *Backend) Publish(ctx context.Context, msgs []*transport.Message) error {
	out := make([]*transport.Message, len(msgs))
	for i, m := range msgs {
		c := *m
		c.Headers = make([]transport.Header, 0, len(m.Headers))
		for _, h := range m.Headers {
			if !strings.HasPrefix(h.Key, "x-") && h.Key != amqp.HeaderOriginQueue && h.Key != contract.HeaderDeadAt &&
				h.Key != contract.HeaderGroup {
				c.Headers = append(c.Headers, h)
			}
		}
		out[i] = &c
	}
	return b.pub.Publish(ctx, out)
}

// DeletePurged implements dlq.Backend. It deletes nothing and returns nil: a
// RabbitMQ letter left the broker when it was indexed; the index keeps its
// bytes.
func (b *Backend) DeletePurged(context.Context, *dlq.Store, []*dlq.Letter) ([]dlq.Position, error) {
	return nil, nil
}

// OwnsQueue implements dlq.QueueBackend: name is one of b's work queues or
// one of their shard queues <queue>.<i>.
func (b *Backend) OwnsQueue(name string) bool {
	for _, q := range b.cfg.Queues {
		if name == q {
			return true
		}
		if i, ok := strings.CutPrefix(name, q+"."); ok && i != "" && strings.Trim(i, "0123456789") == "" {
			return true
		}
	}
	return false
}

// OwnsDLQ implements dlq.QueueBackend: name is the DLQ of one of b's queues.
func (b *Backend) OwnsDLQ(name string) bool {
	for _, q := range b.cfg.Queues {
		if name == contract.DLQName(q) {
			return true
		}
	}
	return false
}
