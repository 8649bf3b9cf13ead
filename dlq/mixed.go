package dlq

import (
	"context"
	"errors"
	"strings"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/transport"
)

// MixedBackend is the Backend of a deployment whose dead letters are on
// both brokers, indexed in one Store: the RabbitMQ queues <queue>.dlq of
// AMQP's queues, and Kafka's <topic>.dlq topics. A letter or a replayed
// message belongs to RabbitMQ when its DLQ is one of AMQP's, or its topic
// (the original work queue a replay goes back to) is one of AMQP's queues
// or their ordered-mode shard queues <queue>.<i>; everything else is
// Kafka's. Kafka's topics and RabbitMQ's queues must not share names.
type MixedBackend struct {
	kafka Backend
	amqp  *AMQPBackend
}

var _ Backend = (*MixedBackend)(nil)

// NewMixedBackend returns the MixedBackend of kafka (normally a
// *KafkaBackend) and rabbit; both are required. Closing them stays the
// caller's.
func NewMixedBackend(kafka Backend, rabbit *AMQPBackend) (*MixedBackend, error) {
	if kafka == nil || rabbit == nil {
		return nil, errors.New("dlq: NewMixedBackend needs a Kafka and a RabbitMQ backend")
	}
	return &MixedBackend{kafka: kafka, amqp: rabbit}, nil
}

// Sync implements Backend: both brokers, RabbitMQ's even when Kafka's
// fails; the errors are joined.
func (b *MixedBackend) Sync(ctx context.Context, s *Store) (SyncResult, error) {
	kr, kerr := b.kafka.Sync(ctx, s)
	ar, aerr := b.amqp.Sync(ctx, s)
	return SyncResult{Read: kr.Read + ar.Read, New: append(kr.New, ar.New...),
		Refused: append(kr.Refused, ar.Refused...)}, errors.Join(kerr, aerr)
}

// Publish implements Backend (transport.Publisher's contract): each message
// goes to its broker; a *transport.RejectedError indexes msgs. If one broker
// fails, the error says nothing of what the other confirmed: replaying again
// is safe, the consumers recognise the id_esdeveniment.
func (b *MixedBackend) Publish(ctx context.Context, msgs []*transport.Message) error {
	var parts [2][]*transport.Message
	var index [2][]int
	for i, m := range msgs {
		k := 0
		if b.amqp.ownsQueue(m.Topic) {
			k = 1
		}
		parts[k] = append(parts[k], m)
		index[k] = append(index[k], i)
	}
	rej := &transport.RejectedError{}
	for k, pub := range []transport.Publisher{b.kafka, b.amqp} {
		if len(parts[k]) == 0 {
			continue
		}
		err := pub.Publish(ctx, parts[k])
		var r *transport.RejectedError
		switch {
		case errors.As(err, &r):
			for j, i := range r.Index {
				rej.Index = append(rej.Index, index[k][i])
				rej.Errs = append(rej.Errs, r.Errs[j])
			}
		case err != nil:
			return err
		}
	}
	if len(rej.Index) > 0 {
		return rej
	}
	return nil
}

// DeletePurged implements Backend: Kafka's letters only (a RabbitMQ letter
// left the broker when it was indexed).
func (b *MixedBackend) DeletePurged(ctx context.Context, s *Store, purged []*Letter) ([]Position, error) {
	var kafka []*Letter
	for _, l := range purged {
		if !b.amqp.ownsDLQ(l.Topic) {
			kafka = append(kafka, l)
		}
	}
	if len(kafka) == 0 {
		return nil, nil
	}
	return b.kafka.DeletePurged(ctx, s, kafka)
}

// ownsQueue reports whether name is one of b's work queues or one of their
// shard queues <queue>.<i>.
func (b *AMQPBackend) ownsQueue(name string) bool {
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

// ownsDLQ reports whether name is the DLQ of one of b's queues.
func (b *AMQPBackend) ownsDLQ(name string) bool {
	for _, q := range b.cfg.Queues {
		if name == contract.DLQName(q) {
			return true
		}
	}
	return false
}
