package amqp

import (
	"context"
	"errors"
	"strconv"

	"github.com/km0/km0/transport"
)

// ShardedPublisher routes each message of ordered mode to shard
// Shard(Key, Shards) by appending ".<shard>" to its routing key (Topic): with
// the default exchange, Topic "inventari.comandes" becomes the queue
// "inventari.comandes.3"; with an exchange, the shard queue i is bound with
// "<key>.<i>" (ConsumerConfig.RoutingKeys). All messages of one key go to one
// queue, which has a single active consumer, so they are processed in the
// order they were published. It wraps any transport.Publisher (normally a
// *Publisher); the caller's messages are not modified.
type ShardedPublisher struct {
	Next   transport.Publisher
	Shards int // must be the consumers' Shards
}

var _ transport.Publisher = ShardedPublisher{}

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
	out := make([]*transport.Message, len(msgs))
	for i, m := range msgs {
		if len(m.Key) == 0 {
			return errors.New("amqp: ShardedPublisher: message without Key (agregat_id)")
		}
		cp := *m
		cp.Topic = m.Topic + "." + strconv.Itoa(Shard(m.Key, s.Shards))
		out[i] = &cp
	}
	return s.Next.Publish(ctx, out)
}
