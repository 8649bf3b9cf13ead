package dlq

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
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// AMQPBatchDefault is how many messages of a RabbitMQ DLQ one index
// transaction takes.
const AMQPBatchDefault = 500

// AMQPConfig configures an AMQPBackend.
type AMQPConfig struct {
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

// AMQPBackend is the Backend of the RabbitMQ queues <queue>.dlq of
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
type AMQPBackend struct {
	cfg AMQPConfig
	pub *amqp.Publisher
	// afterCommit, when set (tests), runs between the index commit and the
	// ack; an error stops Sync there, as a crash would.
	afterCommit func() error
}

var _ Backend = (*AMQPBackend)(nil)

// NewAMQPBackend returns an AMQPBackend. It fails without a Conn or without
// queues; the DLQ queues are first looked up by Sync, which fails for one
// that does not exist.
func NewAMQPBackend(cfg AMQPConfig) (*AMQPBackend, error) {
	if cfg.Conn == nil {
		return nil, errors.New("dlq: AMQPConfig needs Conn")
	}
	var queues []string
	for _, q := range cfg.Queues {
		q = strings.TrimSuffix(strings.TrimSpace(q), contract.DLQSuffix)
		if q != "" && !slices.Contains(queues, q) {
			queues = append(queues, q)
		}
	}
	if len(queues) == 0 {
		return nil, errors.New("dlq: AMQPConfig needs at least one queue")
	}
	cfg.Queues = queues
	cfg.SyncTimeout = cmp.Or(cfg.SyncTimeout, SyncTimeoutDefault)
	cfg.Batch = cmp.Or(cfg.Batch, AMQPBatchDefault)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	pub, err := amqp.NewPublisher(context.Background(), cfg.Conn, amqp.PublisherConfig{Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	return &AMQPBackend{cfg: cfg, pub: pub}, nil
}

// Close closes the publisher's channel (not the Conn).
func (b *AMQPBackend) Close() error { return b.pub.Close() }

// Sync implements Backend: for each DLQ it takes at most the messages the
// queue held when it started, batch by batch (see AMQPBackend). It fails for
// a DLQ queue that does not exist, naming it; what it indexed stays indexed
// and acked.
func (b *AMQPBackend) Sync(ctx context.Context, s *Store) (SyncResult, error) {
	var res SyncResult
	ctx, cancel := context.WithTimeout(ctx, b.cfg.SyncTimeout)
	defer cancel()
	for _, q := range b.cfg.Queues {
		if err := b.syncQueue(ctx, s, q, &res); err != nil {
			return res, err
		}
	}
	return res, nil
}

func (b *AMQPBackend) syncQueue(ctx context.Context, s *Store, queue string, res *SyncResult) error {
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
			ins, err := s.insertQueued(ctx, name, lettersOfDeliveries(queue, batch))
			if err != nil {
				return err // nothing acked: the channel closes and RabbitMQ requeues the batch
			}
			res.Read += len(batch)
			res.New = append(res.New, ins.added...)
			res.Refused = append(res.Refused, ins.refused...)
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

// queued is a letter read from a RabbitMQ DLQ, not yet numbered.
type queued struct {
	l           *Letter
	redelivered bool
}

// lettersOfDeliveries converts deliveries of the DLQ of queue (see amqpLetter).
func lettersOfDeliveries(queue string, ds []amqp091.Delivery) []queued {
	out := make([]queued, len(ds))
	now := time.Now()
	for i := range ds {
		out[i] = queued{l: amqpLetter(queue, &ds[i], now), redelivered: ds[i].Redelivered}
	}
	return out
}

// amqpLetter builds the Letter of a delivery from the DLQ of queue, without
// ID. Headers are sorted by key (so a redelivery compares equal); x-death is
// kept as text for show. The time of death is mort_en, else x-death's, else
// the message timestamp, else now.
func amqpLetter(queue string, d *amqp091.Delivery, now time.Time) *Letter {
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
	l := NewLetter(contract.DLQName(queue), 0, -1, deadAt, m)
	l.OriginalTopic, l.Reason, l.Attempts = dl.Origin, dl.Reason, dl.Attempts
	l.Type = cmp.Or(l.Type, dl.Type)
	return l
}

// insertQueued numbers and indexes letters of one RabbitMQ DLQ in one
// transaction, under an advisory lock per (index table, DLQ), and returns
// the new ones and those set aside. A redelivered letter equal to one
// already indexed or set aside is skipped. A letter the index refuses is set
// aside in cartes_refusades with its bytes (its only copy once acked) and
// its number, which the sequence counts too.
func (s *Store) insertQueued(ctx context.Context, dlqName string, letters []queued) (inserted, error) {
	fail := func(err error) (inserted, error) { return inserted{}, err }
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return fail(fmt.Errorf("dlq: begin: %w", err))
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", s.table+" "+dlqName); err != nil {
		return fail(fmt.Errorf("dlq: lock %s: %w", dlqName, err))
	}
	var next int64
	if err := tx.QueryRow(ctx, "SELECT COALESCE(GREATEST((SELECT max(offset_dlq) FROM "+s.table+" WHERE topic = $1), "+
		"(SELECT max(offset_dlq) FROM "+s.refused+" WHERE topic = $1)) + 1, 0)",
		dlqName).Scan(&next); err != nil {
		return fail(fmt.Errorf("dlq: sequence of %s: %w", dlqName, err))
	}
	fresh := make([]*Letter, 0, len(letters))
	for _, q := range letters {
		l := q.l
		if q.redelivered {
			keys, vals := headerBytes(l.Headers)
			var seen bool
			same := ` WHERE topic = $1 AND morta_en IS NOT DISTINCT FROM $2
				AND valor = $3 AND capcaleres_claus = $4 AND capcaleres_valors = $5`
			if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+s.table+same+") OR EXISTS (SELECT 1 FROM "+s.refused+same+")",
				dlqName, nullTime(l.DeadAt), nonNil(l.Value), keys, vals).Scan(&seen); err != nil {
				return fail(fmt.Errorf("dlq: look up a redelivered letter of %s: %w", dlqName, err))
			}
			if seen {
				continue
			}
		}
		l.Offset, l.ID = next, KafkaID(dlqName, 0, next)
		next++
		fresh = append(fresh, l)
	}
	ins, err := s.insertTx(ctx, tx, fresh)
	if err != nil {
		return fail(err)
	}
	// A collision cannot happen under the lock; never ack a letter neither
	// indexed nor set aside.
	if n := len(ins.added) + ins.setAside; n != len(fresh) || len(ins.refused) != ins.setAside {
		return fail(fmt.Errorf("dlq: %s: %d of %d letters collided with existing IDs", dlqName, len(fresh)-n, len(fresh)))
	}
	if err := tx.Commit(ctx); err != nil {
		return fail(fmt.Errorf("dlq: commit: %w", err))
	}
	return ins, nil
}

// Publish implements Backend: each message goes to the default exchange with
// routing key Topic (the original work queue), mandatory and confirmed, with
// the same value and id_esdeveniment (also the AMQP message_id) and without
// the headers of the dead-lettering (x-*, cua_origen, mort_en, and
// grup_consumidor: the work queue is that consumer's own). Errors are
// amqp.Publisher's: a *amqp.ReturnedError when the queue no longer exists.
func (b *AMQPBackend) Publish(ctx context.Context, msgs []*transport.Message) error {
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

// DeletePurged implements Backend. It deletes nothing and returns nil: a
// RabbitMQ letter left the broker when it was indexed; the index keeps its
// bytes.
func (b *AMQPBackend) DeletePurged(context.Context, *Store, []*Letter) ([]Position, error) {
	return nil, nil
}
