package system

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

// Brokers of Config.Events and Config.EventsByTopic.
const (
	EventsKafka    = "kafka"
	EventsRabbitMQ = "rabbitmq"
)

// EventsExchangeDefault is the topic exchange of the domain events over
// RabbitMQ (Config.EventsExchange).
const EventsExchangeDefault = "km0.esdeveniments"

// EventShards is the number of ordered-mode queues of each consumer of the
// events over RabbitMQ, and the modulus of the relays' routing
// (amqp.Shard(agregat_id, EventShards)): the partitions of the Kafka topics.
// Publishers and consumers must agree on it.
const EventShards = kafka.PartitionsDefault

// Subscriptions are the domain topics each consumidor reads (CONTRACT.md's
// event flow), by their contract names.
var Subscriptions = map[string][]string{
	comandes.ConsumerPaymentConfirmed: {pagaments.Topic},
	comandes.ConsumerStockRefused:     {inventari.Topic},
	comandes.ConsumerDelivery:         {repartiment.Topic},
	inventari.ConsumerDecrement:       {comandes.Topic},
	pagaments.ConsumerCharge:          {comandes.Topic},
	repartiment.ConsumerAssign:        {comandes.Topic},
	analitica.ConsumerCount:           {comandes.Topic, inventari.Topic, pagaments.Topic, repartiment.Topic},
	cataleg.ConsumerLowStock:          {inventari.Topic},
}

// unordered are the consumidors that need no order per key over RabbitMQ:
// analitica counts, at most once. Every other consumer reads EventShards
// single-active-consumer queues, so that the events of one aggregate reach
// it in the order they were committed (cataleg's flag must follow the last
// stock; comandes, repartiment and pagaments see an order's events in order).
var unordered = []string{analitica.ConsumerCount}

// amqpNameRE: an exchange name or queue prefix RabbitMQ takes, leaving room
// for the queue names built on it (short strings are 255 bytes at most).
var amqpNameRE = regexp.MustCompile(`^[a-zA-Z0-9._:-]{0,200}$`)

// validateEvents checks Config.Events, EventsByTopic and the brokers they need.
func (cfg *Config) validateEvents() error {
	if err := cfg.validateEventBrokers(); err != nil {
		return err
	}
	if cfg.onRabbitMQ() && cfg.AMQPURL == "" {
		return errors.New("events over RabbitMQ need Config.AMQPURL")
	}
	if !amqpNameRE.MatchString(cfg.EventsExchange) || strings.HasPrefix(cfg.EventsExchange, "amq.") {
		return fmt.Errorf("Config.EventsExchange %q: want at most 200 of a-z A-Z 0-9 . _ : - (amq.* is reserved)", cfg.EventsExchange)
	}
	if !amqpNameRE.MatchString(cfg.EventsQueuePrefix) || strings.HasPrefix(cfg.EventsQueuePrefix, "amq.") {
		return fmt.Errorf("Config.EventsQueuePrefix %q: want at most 200 of a-z A-Z 0-9 . _ : - (amq.* is reserved)", cfg.EventsQueuePrefix)
	}
	if len(cfg.Brokers) == 0 && (cfg.onKafka() || cfg.AMQPURL == "") {
		return errors.New("Config.Brokers is required (Kafka carries events or request/reply)")
	}
	return nil
}

// validateEventBrokers checks the names in Config.Events and EventsByTopic.
func (cfg *Config) validateEventBrokers() error {
	valid := func(b string) bool { return b == EventsKafka || b == EventsRabbitMQ }
	if cfg.Events != "" && !valid(cfg.Events) {
		return fmt.Errorf("Config.Events %q: want %q or %q", cfg.Events, EventsKafka, EventsRabbitMQ)
	}
	contract := slices.Sorted(maps.Values(Topics))
	for t, b := range cfg.EventsByTopic {
		if !slices.Contains(contract, t) {
			return fmt.Errorf("events broker of unknown topic %q (known: %s)", t, strings.Join(contract, ", "))
		}
		if !valid(b) {
			return fmt.Errorf("events broker %q of %s: want %q or %q", b, t, EventsKafka, EventsRabbitMQ)
		}
	}
	return nil
}

// eventsBroker returns the broker of contract topic t.
func (cfg *Config) eventsBroker(t string) string {
	return cmp.Or(cfg.EventsByTopic[t], cfg.Events, EventsKafka)
}

func (cfg *Config) onKafka() bool    { return cfg.anyTopicOn(EventsKafka) }
func (cfg *Config) onRabbitMQ() bool { return cfg.anyTopicOn(EventsRabbitMQ) }

func (cfg *Config) anyTopicOn(broker string) bool {
	for _, t := range Topics {
		if cfg.eventsBroker(t) == broker {
			return true
		}
	}
	return false
}

// kafkaTopics are the domain topics on Kafka with their .retry and .dlq
// topics, renamed (Config.Topics).
func (cfg *Config) kafkaTopics() []string {
	var out []string
	for _, s := range Services {
		if t, ok := Topics[s]; ok && cfg.eventsBroker(t) == EventsKafka {
			t = cmp.Or(cfg.Topics[t], t)
			out = append(out, t, contract.RetryTopic(t), contract.DLQName(t))
		}
	}
	return out
}

// EventsBroker names the broker of each domain topic (contract names).
func (s *System) EventsBroker() map[string]string {
	out := map[string]string{}
	for _, t := range Topics {
		out[t] = s.cfg.eventsBroker(t)
	}
	return out
}

func (s *System) exchange() string { return cmp.Or(s.cfg.EventsExchange, EventsExchangeDefault) }

// amqpSub is one consumer's subscription over RabbitMQ.
type amqpSub struct {
	queue  string   // the logical queue: its shards are <queue>.<i>, its DLQ <queue>.dlq
	keys   []string // routing keys: the topic names
	shards int      // 0: one plain queue
}

// amqpSub returns the subscription of consumidor name to topics (contract
// names): the queue named after its group, behind Config.EventsQueuePrefix.
// The routing keys are the topic names, ordered or not: ordered consumers
// reach their shard by the relays' particio header (amqp.SourceConfig.Topology).
func (s *System) amqpSub(name string, topics []string) amqpSub {
	sub := amqpSub{queue: s.cfg.EventsQueuePrefix + cmp.Or(s.cfg.Groups[name], name)}
	if !slices.Contains(unordered, name) {
		sub.shards = EventShards
	}
	for _, t := range topics {
		sub.keys = append(sub.keys, s.topic(t))
	}
	return sub
}

// source is sub's amqp.SourceConfig on exchange, without a Conn: what
// declaring it early (startEvents) and the consumer's NewSource agree on.
func (sub amqpSub) source(exchange string) amqp.SourceConfig {
	return amqp.SourceConfig{Queue: sub.queue, Exchange: exchange, RoutingKeys: sub.keys, Shards: sub.shards}
}

// rabbitTopics returns those of topics (contract names) that travel over RabbitMQ.
func (s *System) rabbitTopics(topics []string) []string {
	var out []string
	for _, t := range topics {
		if s.cfg.eventsBroker(t) == EventsRabbitMQ {
			out = append(out, t)
		}
	}
	return out
}

// startEvents connects to RabbitMQ for the events, declares the exchange and
// the queues of every consumer of the system (of the services this process
// does not run too: a relay must never publish before the queues that will
// read its events exist, or RabbitMQ drops those events for them), and
// opens the relays' publisher.
func (s *System) startEvents(ctx context.Context) error {
	conn, err := amqp.Dial(ctx, amqp.Config{URL: s.cfg.AMQPURL, Name: "km0-events", Logger: s.log, TLS: s.cfg.AMQPTLS})
	if err != nil {
		return fmt.Errorf("events over RabbitMQ: %w", err)
	}
	s.events = conn
	topo := EventsTopology(s.cfg)
	if err := conn.Declare(ctx, topo); err != nil {
		return fmt.Errorf("events topology: %w", err)
	}
	s.sup.noteQueues(topo.QueueNames())
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: s.exchange(), Logger: s.log})
	if err != nil {
		return err
	}
	s.amqpPub = pub
	return nil
}

// EventsTopology returns the RabbitMQ topology a process started with cfg
// declares for the events cfg puts on RabbitMQ (Events, EventsByTopic): the
// exchange, every consumer's queues, the dead-letter exchange and the DLQs,
// with their arguments and bindings. Empty when no event goes there. km0
// doctor checks a broker against it.
func EventsTopology(cfg Config) amqp.Topology {
	s := &System{cfg: cfg}
	var topo amqp.Topology
	for _, name := range ConsumerNames {
		if topics := s.rabbitTopics(Subscriptions[name]); len(topics) > 0 {
			topo = topo.Merge(s.amqpSub(name, topics).source(s.exchange()).Topology())
		}
	}
	return topo
}

// eventsPublisher is the relays' publisher of contract topic t.
func (s *System) eventsPublisher(t string) transport.Publisher {
	if s.cfg.eventsBroker(t) == EventsRabbitMQ {
		return amqp.ShardedPublisher{Next: s.amqpPub, Shards: EventShards}
	}
	return s.pub
}

// amqpSource is the RabbitMQ source of consumer cfg on topics (contract
// names): its queues (amqpSub), each channel's prefetch at least a batch
// (a batch takes only what the client already holds).
func (s *System) amqpSource(cfg consumer.Config, topics []string) amqp.SourceConfig {
	src := s.amqpSub(cfg.Name, topics).source(s.exchange())
	src.Conn = s.events
	src.Prefetch = max(amqp.PrefetchDefault, cmp.Or(cfg.BatchSize, consumer.BatchSizeDefault))
	return src
}

// EventsConn returns the connection of the events to RabbitMQ (the caller
// must not close it; Close does), or nil when no event travels there.
func (s *System) EventsConn() *amqp.Conn { return s.events }

// EventsConsumerQueues returns, for every consumer whose events travel over
// RabbitMQ (all six, whichever services this process runs: every process
// declares their queues), the queues it reads (the EventShards shard queues
// <queue>.<i>, or analitica's one queue) and its dead-letter queue
// <queue>.dlq, each list sorted. Empty when no event travels over RabbitMQ.
func (s *System) EventsConsumerQueues() (work, dead []string) {
	for _, name := range ConsumerNames {
		topics := s.rabbitTopics(Subscriptions[name])
		if len(topics) == 0 {
			continue
		}
		sub := s.amqpSub(name, topics)
		dead = append(dead, contract.DLQName(sub.queue))
		if sub.shards == 0 {
			work = append(work, sub.queue)
		}
		for i := range sub.shards {
			work = append(work, amqp.ShardQueueName(sub.queue, i))
		}
	}
	slices.Sort(work)
	slices.Sort(dead)
	return work, dead
}

// DeadLetterReasons returns the motiu of each message this process's
// RabbitMQ consumers dead-lettered as a permanent failure, by consumidor and
// then id_esdeveniment. RabbitMQ moves such a message to <queue>.dlq by a
// native nack, which carries no motiu; this is where it is kept (the
// first maxReasons of them).
func (s *System) DeadLetterReasons() map[string]map[string]string {
	return s.reasons.snapshot()
}

const maxReasons = 100_000

type reasons struct {
	mu sync.Mutex
	n  int
	by map[string]map[string]string
}

// observer is a consumer's OnDeadLetter that notes the motiu of each
// permanent failure (the one a native nack cannot carry).
func (r *reasons) observer(name string) func(context.Context, *consumer.Message, string) {
	return func(_ context.Context, m *consumer.Message, motiu string) {
		if !strings.HasPrefix(motiu, contract.ReasonPermanent) {
			return // an exhausted copy carries its motiu itself
		}
		id := ""
		if m.Envelope != nil {
			id = m.Envelope.ID
		} else if m.Message != nil {
			id, _ = m.Header(contract.HeaderEventID)
		}
		r.note(name, id, motiu)
	}
}

func (r *reasons) note(name, eventID, motiu string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n >= maxReasons {
		return
	}
	if r.by == nil {
		r.by = map[string]map[string]string{}
	}
	if r.by[name] == nil {
		r.by[name] = map[string]string{}
	}
	if _, ok := r.by[name][eventID]; !ok {
		r.n++
	}
	r.by[name][eventID] = motiu
}

func (r *reasons) snapshot() map[string]map[string]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]map[string]string{}
	for k, v := range r.by {
		out[k] = maps.Clone(v)
	}
	return out
}

// NeedsKafka reports whether cfg puts anything on Kafka: a domain topic, or
// request/reply (no AMQPURL).
func (cfg *Config) NeedsKafka() bool { return cfg.onKafka() || cfg.AMQPURL == "" }

// NeedsRabbitMQ reports whether cfg puts a domain topic on RabbitMQ.
func (cfg *Config) NeedsRabbitMQ() bool { return cfg.onRabbitMQ() }

// ParseEvents parses the events choice of km0 up, serve and demo:
// BROKER[,TOPIC=BROKER...], e.g. "rabbitmq" or
// "kafka,comandes.esdeveniments=rabbitmq". Empty: Kafka for every topic.
func ParseEvents(s string) (broker string, byTopic map[string]string, err error) {
	for i, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		t, b, ok := strings.Cut(part, "=")
		if !ok {
			if i != 0 {
				return "", nil, fmt.Errorf("events %q: only the first item may be a broker without a topic", s)
			}
			broker = t
			continue
		}
		if byTopic == nil {
			byTopic = map[string]string{}
		}
		if _, dup := byTopic[strings.TrimSpace(t)]; dup {
			return "", nil, fmt.Errorf("events %q: %s given twice", s, t)
		}
		byTopic[strings.TrimSpace(t)] = strings.TrimSpace(b)
	}
	cfg := Config{Events: broker, EventsByTopic: byTopic}
	if err := cfg.validateEventBrokers(); err != nil {
		return "", nil, err
	}
	return broker, byTopic, nil
}
