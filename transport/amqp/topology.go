package amqp

import (
	"context"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
)

// Names of CONTRACT.md.
const (
	// DLXDefault is the dead-letter exchange (direct) every work queue names
	// in x-dead-letter-exchange.
	DLXDefault = "km0.dlx"
)

// Queue arguments RabbitMQ interprets.
const (
	ArgDeadLetterExchange   = "x-dead-letter-exchange"
	ArgDeadLetterRoutingKey = "x-dead-letter-routing-key"
	argMessageTTL           = "x-message-ttl"
	argExpires              = "x-expires"
	argSingleActiveConsumer = "x-single-active-consumer"
	// argMatch is a headers exchange binding's x-match ("all" or "any").
	argMatch = "x-match"
)

// Exchange is an exchange declaration. Kind defaults to "direct". Names that
// start with "amq." are predeclared by RabbitMQ and are not declared again.
// AutoDelete: RabbitMQ deletes the exchange when the last queue or exchange
// bound to it is unbound (or deleted).
type Exchange struct {
	Name       string
	Kind       string
	Durable    bool
	AutoDelete bool
	Args       amqp.Table
}

// Queue is a queue declaration.
type Queue struct {
	Name       string
	Durable    bool
	Exclusive  bool
	AutoDelete bool
	Args       amqp.Table
}

// Binding binds Queue to Exchange with routing key Key, and Args for a
// headers exchange (x-match and the header values to match).
type Binding struct {
	Queue    string
	Exchange string
	Key      string
	Args     amqp.Table
}

// ExchangeBinding binds exchange Destination to exchange Source with routing
// key Key (RabbitMQ's exchange-to-exchange binding): what Source routes with
// a matching key also goes through Destination.
type ExchangeBinding struct {
	Destination string
	Source      string
	Key         string
}

// Topology is a set of declarations applied in order: exchanges, queues,
// exchange bindings, bindings. Declarations are idempotent in RabbitMQ as
// long as the arguments match; a mismatch is a PRECONDITION_FAILED error
// naming the entity.
type Topology struct {
	Exchanges        []Exchange
	Queues           []Queue
	ExchangeBindings []ExchangeBinding
	Bindings         []Binding
}

// Merge returns t followed by o.
func (t Topology) Merge(o Topology) Topology {
	return Topology{
		Exchanges:        append(append([]Exchange(nil), t.Exchanges...), o.Exchanges...),
		Queues:           append(append([]Queue(nil), t.Queues...), o.Queues...),
		ExchangeBindings: append(append([]ExchangeBinding(nil), t.ExchangeBindings...), o.ExchangeBindings...),
		Bindings:         append(append([]Binding(nil), t.Bindings...), o.Bindings...),
	}
}

// QueueNames returns the names of t's queues.
func (t Topology) QueueNames() []string {
	out := make([]string, len(t.Queues))
	for i, q := range t.Queues {
		out[i] = q.Name
	}
	return out
}

func (t Topology) apply(ctx context.Context, ch *amqp.Channel) error {
	for _, e := range t.Exchanges {
		if strings.HasPrefix(e.Name, "amq.") || e.Name == "" {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		kind := e.Kind
		if kind == "" {
			kind = amqp.ExchangeDirect
		}
		if err := ch.ExchangeDeclare(e.Name, kind, e.Durable, e.AutoDelete, false, false, e.Args); err != nil {
			return fmt.Errorf("amqp: declare exchange %q: %w", e.Name, err)
		}
	}
	for _, q := range t.Queues {
		if err := ctx.Err(); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(q.Name, q.Durable, q.AutoDelete, q.Exclusive, false, q.Args); err != nil {
			return fmt.Errorf("amqp: declare queue %q: %w", q.Name, err)
		}
	}
	for _, b := range t.ExchangeBindings {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := ch.ExchangeBind(b.Destination, b.Key, b.Source, false, nil); err != nil {
			return fmt.Errorf("amqp: bind exchange %q to %q with key %q: %w", b.Destination, b.Source, b.Key, err)
		}
	}
	for _, b := range t.Bindings {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := ch.QueueBind(b.Queue, b.Key, b.Exchange, false, b.Args); err != nil {
			return fmt.Errorf("amqp: bind queue %q to %q with key %q: %w", b.Queue, b.Exchange, b.Key, err)
		}
	}
	return nil
}

// ShardQueueName returns <queue>.<i>, the i-th queue of ordered mode.
func ShardQueueName(queue string, i int) string { return queue + "." + strconv.Itoa(i) }

// Shard returns the ordered-mode shard of key among n: FNV-1a (32 bit) of the
// key bytes, modulo n. Other languages reproduce it in a few lines, so any
// publisher can route like km0's. n <= 1 gives 0.
func Shard(key []byte, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write(key)
	return int(h.Sum32() % uint32(n))
}

// WorkQueueTopology is CONTRACT.md's dead-letter topology for queue:
// the direct exchange dlx (km0.dlx when empty), the durable queue
// <dlqKey>.dlq bound to it with routing key dlqKey, and the durable work
// queue declared with x-dead-letter-exchange = dlx and
// x-dead-letter-routing-key = dlqKey. dlqKey is queue itself, except for the
// queues of ordered mode, which share the DLQ of their logical queue.
// singleActive adds x-single-active-consumer.
func WorkQueueTopology(dlx, queue, dlqKey string, singleActive bool) Topology {
	if dlx == "" {
		dlx = DLXDefault
	}
	if dlqKey == "" {
		dlqKey = queue
	}
	args := amqp.Table{ArgDeadLetterExchange: dlx, ArgDeadLetterRoutingKey: dlqKey}
	if singleActive {
		args[argSingleActiveConsumer] = true
	}
	return Topology{
		Exchanges: []Exchange{{Name: dlx, Kind: amqp.ExchangeDirect, Durable: true}},
		Queues: []Queue{
			{Name: contract.DLQName(dlqKey), Durable: true},
			{Name: queue, Durable: true, Args: args},
		},
		Bindings: []Binding{{Queue: contract.DLQName(dlqKey), Exchange: dlx, Key: dlqKey}},
	}
}

// waitQueue is the declaration of the wait queue of queue for delay: a
// durable queue whose x-message-ttl is delay and whose expired messages
// dead-letter through the default exchange back to queue. x-expires removes
// it after expires without use (it is redeclared before each use).
func waitQueue(queue string, delay, expires time.Duration) Queue {
	return Queue{Name: contract.WaitQueueName(queue, delay), Durable: true, Args: amqp.Table{
		argMessageTTL:           delay.Milliseconds(),
		ArgDeadLetterExchange:   "",
		ArgDeadLetterRoutingKey: queue,
		argExpires:              (delay + expires).Milliseconds(),
	}}
}
