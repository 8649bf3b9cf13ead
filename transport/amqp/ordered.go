package amqp

import (
	"context"
	"errors"
	"slices"
	"strconv"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/transport"
)

// ShardedPublisher routes each message of ordered mode to shard
// Shard(Key, Shards) and names it in header particio (contract.HeaderPartition, a
// decimal string). How the shard reaches its queue depends on where Next
// publishes:
//
//   - to an exchange (Next reports a non-empty Exchange(), as a *Publisher
//     with PublisherConfig.Exchange does): the routing key stays Topic, the
//     topic name, so any queue bound with it receives the message; each
//     ordered consumer routes on the header through its own headers exchange
//     to its shard queue (SourceConfig.Topology);
//   - to the default exchange: ".<shard>" is appended to Topic, the queue
//     name: Topic "inventari.descompte_estoc" becomes the queue "inventari.descompte_estoc.3".
//
// All messages of one key go to one queue, which has a single active
// consumer, so they are processed in the order they were published. It
// wraps any transport.Publisher (normally a *Publisher); the caller's
// messages are not modified.
type ShardedPublisher struct {
	Next   transport.Publisher
	Shards int // must be the consumers' Shards
}

var _ transport.Publisher = ShardedPublisher{}

// exchanger is what ShardedPublisher asks Next: the exchange it publishes
// to ("" is the default exchange). *Publisher implements it.
type exchanger interface{ Exchange() string }

// Publish implements transport.Publisher with Next's guarantees and errors.
// Shards < 1 is an error; Shards 1 passes the messages through unchanged;
// with Shards > 1 a message without Key is an error (give it its agregat_id).
func (s ShardedPublisher) Publish(ctx context.Context, msgs []*transport.Message) error {
	if s.Next == nil || s.Shards < 1 {
		return errors.New("amqp: ShardedPublisher needs Next and Shards >= 1")
	}
	if s.Shards == 1 {
		return s.Next.Publish(ctx, msgs)
	}
	toExchange := false
	if e, ok := s.Next.(exchanger); ok {
		toExchange = e.Exchange() != ""
	}
	out := make([]*transport.Message, len(msgs))
	for i, m := range msgs {
		if len(m.Key) == 0 {
			return errors.New("amqp: ShardedPublisher: message without Key (agregat_id)")
		}
		shard := strconv.Itoa(Shard(m.Key, s.Shards))
		cp := *m
		cp.Headers = slices.Clone(m.Headers)
		cp.SetHeader(contract.HeaderPartition, shard)
		if !toExchange {
			cp.Topic = m.Topic + "." + shard
		}
		out[i] = &cp
	}
	return s.Next.Publish(ctx, out)
}
