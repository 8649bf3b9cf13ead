package amqp

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
)

// Defaults of SourceConfig.
const (
	WaitQueueExpiryDefault = 30 * time.Minute
	StandbyDelayDefault    = 2 * time.Second
)

// SourceConfig configures a RabbitMQ Source.
type SourceConfig struct {
	Conn  *Conn  // required
	Queue string // required: the work queue, e.g. "inventari.descompte_estoc"

	// Exchange and RoutingKeys bind the work queue to Exchange, declared
	// durable of kind ExchangeKind (default "topic"); in ordered mode the
	// shard queues are reached through a headers exchange of their own
	// (see Topology). Empty Exchange: no binding; publishers then use the
	// default exchange with the queue name (ordered: <Queue>.<i>) as key.
	Exchange     string
	ExchangeKind string
	RoutingKeys  []string

	// Shards > 1 selects ordered mode: queues <Queue>.<i>, i < Shards, each
	// with x-single-active-consumer and one worker; publishers route with
	// ShardedPublisher (Shard(key, Shards)). Every instance consumes all
	// shards; the broker lets one consumer per shard be active.
	Shards int
	// Instance and Instances spread the active shards in ordered mode: the
	// instance subscribes first to shards i with i % Instances == Instance and
	// to the others StandbyDelay later (RabbitMQ makes the first consumer of a
	// queue the active one). Instances 0: subscribe to all at once.
	Instance, Instances int
	StandbyDelay        time.Duration // default 2 s

	// Prefetch per channel (one channel per queue). Default 32; at least
	// the consumer's BatchSize is useful for batches of that size.
	Prefetch int
	// Workers per plain queue (order is not kept between them). Default:
	// the consumer's Concurrency. Ordered mode always uses 1 per shard.
	Workers int

	DLX             string        // default "km0.dlx"
	WaitQueueExpiry time.Duration // x-expires of idle wait queues beyond their TTL; default 30 min
}

func (c SourceConfig) withDefaults() SourceConfig {
	c.ExchangeKind = cmp.Or(c.ExchangeKind, amqp.ExchangeTopic)
	if c.StandbyDelay <= 0 {
		c.StandbyDelay = StandbyDelayDefault
	}
	if c.Prefetch <= 0 {
		c.Prefetch = PrefetchDefault
	}
	c.DLX = cmp.Or(c.DLX, DLXDefault)
	if c.WaitQueueExpiry <= 0 {
		c.WaitQueueExpiry = WaitQueueExpiryDefault
	}
	return c
}

func (c SourceConfig) validate() error {
	switch {
	case c.Conn == nil:
		return errors.New("amqp: source: Conn is required")
	case c.Queue == "":
		return errors.New("amqp: source: Queue is required")
	case c.Shards > 1 && c.Instances > 0 && (c.Instance < 0 || c.Instance >= c.Instances):
		return fmt.Errorf("amqp: source: Instance %d out of range [0, %d)", c.Instance, c.Instances)
	}
	return nil
}

// Source is the RabbitMQ half of a consumer (transport.Source): it consumes
// a work queue (or the shard queues of ordered mode) and hands each worker's
// deliveries to the pipeline in batches of what the broker already pushed
// (at most BatchSize). It acks a delivery only after the pipeline returned
// it done (AtLeastOnce), and carries out each failure:
//
//   - permanent (outcome.Permanent, an undecodable envelope, a tipus header
//     that disagrees with it): basic.nack with requeue=false, so RabbitMQ
//     dead-letters it to <queue>.dlq through the DLX at once;
//   - transient, attempts left: a copy with intents = attempt goes to the
//     wait queue <queue>.espera.<ms>, whose TTL dead-letters it back to the
//     work queue; the original is acked after the copy is confirmed;
//   - transient, attempts exhausted: a copy with motiu "transitori esgotat: …"
//     is published to the DLX (so it lands in <queue>.dlq with its reason)
//     and the original is acked after the confirm.
//
// requeue=true is never used. Build it with NewSource and give it to
// consumer.Config.Source.
type Source struct {
	cfg    SourceConfig
	pub    *Publisher
	queues []consumedQueue
	topo   Topology

	p   transport.Pipeline
	set transport.PipelineSettings
	log *slog.Logger

	waitMu   sync.Mutex
	declared map[string]waitDecl
}

var _ transport.Source = (*Source)(nil)

type consumedQueue struct {
	name  string
	shard int
}

type waitDecl struct {
	gen uint64
	at  time.Time
}

// NewSource validates cfg, declares the topology (registered on the Conn
// for reconnects) and returns the Source. It does not consume: the
// consumer's Run does.
func NewSource(ctx context.Context, cfg SourceConfig) (*Source, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	s := &Source{cfg: cfg, declared: map[string]waitDecl{}}
	topo := cfg.Topology()
	if cfg.Shards > 1 {
		for i := range cfg.Shards {
			s.queues = append(s.queues, consumedQueue{name: ShardQueueName(cfg.Queue, i), shard: i})
		}
	} else {
		s.queues = []consumedQueue{{name: cfg.Queue}}
	}
	if err := cfg.Conn.Declare(ctx, topo); err != nil {
		return nil, err
	}
	s.topo = topo
	return s, nil
}

// Topology returns what NewSource declares for c (its defaults filled in):
// the work queue, or in ordered mode the shard queues <Queue>.<i>, with the
// DLX and <Queue>.dlq; with an Exchange, the bindings. A plain queue is
// bound to Exchange with each routing key. In ordered mode the routing keys
// bind the headers exchange <Queue>.particions (auto-deleted with the last
// shard queue) to Exchange, and shard queue i is bound to it with x-match
// all on header particio = "i": the publisher keeps the routing key (the
// topic) and names the shard in the header (ShardedPublisher), so that a
// queue bound to Exchange with the topic name alone also receives every
// message. Declaring it before any publisher starts is what makes sure no
// message is dropped for want of a queue.
func (c SourceConfig) Topology() Topology {
	c = c.withDefaults()
	var topo Topology
	if c.Exchange != "" {
		topo.Exchanges = append(topo.Exchanges, Exchange{Name: c.Exchange, Kind: c.ExchangeKind, Durable: true})
	}
	if c.Shards <= 1 {
		topo = topo.Merge(WorkQueueTopology(c.DLX, c.Queue, c.Queue, false))
		if c.Exchange != "" {
			for _, k := range c.RoutingKeys {
				topo.Bindings = append(topo.Bindings, Binding{Queue: c.Queue, Exchange: c.Exchange, Key: k})
			}
		}
		return topo
	}
	parts := contract.PartitionsExchangeName(c.Queue)
	if c.Exchange != "" {
		topo.Exchanges = append(topo.Exchanges, Exchange{Name: parts, Kind: amqp.ExchangeHeaders, Durable: true, AutoDelete: true})
		for _, k := range c.RoutingKeys {
			topo.ExchangeBindings = append(topo.ExchangeBindings, ExchangeBinding{Destination: parts, Source: c.Exchange, Key: k})
		}
	}
	for i := range c.Shards {
		name := ShardQueueName(c.Queue, i)
		topo = topo.Merge(WorkQueueTopology(c.DLX, name, c.Queue, true))
		if c.Exchange != "" {
			topo.Bindings = append(topo.Bindings, Binding{Queue: name, Exchange: parts,
				Args: amqp.Table{argMatch: "all", contract.HeaderPartition: strconv.Itoa(i)}})
		}
	}
	return topo
}

// Label returns the work queue.
func (s *Source) Label() string { return s.cfg.Queue }

// Queues returns every queue the source declared: work (or shard) queues,
// the DLQ and the wait queues used so far.
func (s *Source) Queues() []string {
	out := s.topo.QueueNames()
	s.waitMu.Lock()
	for q := range s.declared {
		out = append(out, q)
	}
	s.waitMu.Unlock()
	slices.Sort(out)
	return slices.Compact(out)
}

// errRunTwice is returned by a second Run of one Source.
var errRunTwice = errors.New("amqp: a Source runs in one consumer only")

// Run consumes until ctx ends, then lets the batches in hand finish (within
// the pipeline's ShutdownTimeout, after which their work is abandoned and
// the broker redelivers them) and returns nil. Connection failures are
// healed inside (Conn.Subscribe). It returns an error if the Conn is closed,
// and the pipeline's crash error after a crash point fired.
func (s *Source) Run(ctx context.Context, p transport.Pipeline) error {
	if s.p != nil {
		return errRunTwice
	}
	s.p, s.set = p, p.Settings()
	s.log = cmp.Or(s.set.Logger, slog.Default())
	pub, err := NewPublisher(ctx, s.cfg.Conn, PublisherConfig{Logger: s.log})
	if err != nil {
		return err
	}
	s.pub = pub
	defer s.pub.Close() //nolint:errcheck // best effort

	// work runs the transactions: it outlives ctx by ShutdownTimeout, so a
	// clean stop finishes the batches in hand; a crash cancels it at once.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	subCtx, cancelSub := context.WithCancel(ctx)
	defer cancelSub()
	go func() {
		select {
		case <-p.Crashed():
			cancelSub()
			cancelWork()
		case <-ctx.Done():
			t := time.AfterFunc(s.set.ShutdownTimeout, func() {
				s.log.Warn("consumer: shutdown timeout; abandoning in-flight work", "timeout", s.set.ShutdownTimeout)
				cancelWork()
			})
			select {
			case <-work.Done():
			case <-p.Crashed():
				cancelWork()
			}
			t.Stop()
		case <-work.Done():
		}
	}()

	var wg sync.WaitGroup
	errs := make(chan error, len(s.queues))
	for _, q := range s.queues {
		workers := cmp.Or(s.cfg.Workers, s.set.Concurrency, 1)
		var delay time.Duration
		if s.cfg.Shards > 1 {
			workers = 1
			if s.cfg.Instances > 0 && q.shard%s.cfg.Instances != s.cfg.Instance {
				delay = s.cfg.StandbyDelay
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if delay > 0 {
				select {
				case <-time.After(delay):
				case <-subCtx.Done():
					return
				}
			}
			sc := SubscribeConfig{Queue: q.name, Prefetch: s.cfg.Prefetch, Workers: workers, Logger: s.log}
			stop := subCtx.Done()
			err := s.cfg.Conn.subscribe(subCtx, sc, s.set.BatchSize, func(_ context.Context, ds []*amqp.Delivery) {
				s.handle(work, stop, q, ds)
			})
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := p.Err(); err != nil {
		return err
	}
	return <-errs
}

// handle runs one worker's batch to the end: ack, nack or move each.
func (s *Source) handle(work context.Context, stop <-chan struct{}, q consumedQueue, ds []*amqp.Delivery) {
	batch := &transport.Batch{Deliveries: make([]*transport.Delivery, len(ds)), Stop: stop}
	for i, d := range ds {
		batch.Deliveries[i] = s.delivery(q, d)
	}
	if s.set.AtMostOnce {
		select {
		case <-stop:
			return // stopping: ack nothing new; unacked, the broker requeues it
		default:
		}
		// Ack first: a crash from here on loses the message, by choice. A
		// clean stop does not: the acked message is handled to the end with
		// the work context, which outlives the stop by ShutdownTimeout.
		for _, d := range ds {
			_ = d.Ack(false)
		}
	}
	fails, err := s.p.Handle(work, batch)
	if err != nil {
		return // crashed or abandoned: nothing settled, the broker redelivers
	}
	failed := make(map[*transport.Delivery]bool, len(fails))
	for _, f := range fails {
		failed[f.D] = true
	}
	if !s.set.AtMostOnce {
		// The effects are committed: ack now. A lost ack redelivers the
		// message, and the recorded key turns it into a duplicate.
		for i, d := range ds {
			if !failed[batch.Deliveries[i]] {
				_ = d.Ack(false)
			}
		}
	}
	if len(fails) == 0 {
		return
	}
	s.settle(work, q, fails)
}

// delivery converts d for the pipeline. A copy back from a wait queue
// carries intents; it is trusted no further than MaxAttempts
// (contract.Attempt). No header: attempt 1.
func (s *Source) delivery(q consumedQueue, d *amqp.Delivery) *transport.Delivery {
	td := &transport.Delivery{Message: FromDelivery(d), Origin: s.cfg.Queue, Partition: int32(q.shard), Offset: -1,
		Timestamp: d.Timestamp, Attempt: 1, Types: typeHeader(d.Headers), Ref: d}
	if v, ok := d.Headers[contract.HeaderAttempts]; ok {
		str, _ := headerString(v)
		td.Attempt = contract.Attempt(str, s.set.MaxAttempts)
	}
	td.FirstFailure, _ = headerTime(d.Headers, contract.HeaderFirstFailure)
	return td
}

// typeHeader reads the tipus header of a delivery. An AMQP table holds one
// value per name, but of any type: one that is not a string (or bytes)
// makes the header ambiguous.
func typeHeader(t amqp.Table) *contract.TypeHeader {
	var th contract.TypeHeader
	switch v := t[contract.HeaderType].(type) {
	case nil:
		if _, ok := t[contract.HeaderType]; ok {
			th.Add("")
		}
	case string:
		th.Add(v)
	case []byte:
		th.Add(string(v))
	default:
		str, _ := headerString(v)
		th.AddNotText(fmt.Sprintf("%s (%T)", str, v))
	}
	return &th
}

// settle carries out the pipeline's decisions for failed deliveries: the
// copies first (confirmed), then the pipeline's Settled (the crash point
// before the originals are settled), then the originals (ack, or a native
// nack to the DLX).
func (s *Source) settle(work context.Context, q consumedQueue, fails []*transport.Settlement) {
	var native []*transport.Settlement
	var moved, done []*transport.Settlement
	lost := map[*transport.Delivery]bool{} // a Copy that could not be published: D goes back to the queue
	for _, f := range fails {
		d := f.D.Ref.(*amqp.Delivery)
		cf := f
		if f.Copy != nil {
			// A message of the pipeline's store: copied from its fields,
			// never nacked natively (it has no delivery of its own).
			d = storedDelivery(f.Copy)
			c := *f
			c.D = f.Copy
			cf = &c
		}
		switch {
		case f.Dead && f.Permanent && !s.set.AtMostOnce && f.Copy == nil:
			native = append(native, f)
		case f.Dead:
			if s.deadLetterCopy(work, d, q, cf) {
				moved = append(moved, f)
			} else if f.Copy != nil {
				lost[f.D] = true
			} else if work.Err() == nil {
				native = append(native, f)
			}
		default:
			if s.retryCopy(work, d, q, cf) {
				moved = append(moved, f)
			} else if f.Copy != nil {
				lost[f.D] = true
			} else if work.Err() == nil {
				s.deadInstead(f, errNoCopy)
				native = append(native, f)
			}
		}
	}
	done = append(append(done, moved...), native...)
	if s.p.Settled(work, done) != nil {
		return // crashed before the originals were settled: redelivered
	}
	// Each delivery is settled once, even when several settlements name it.
	settled := map[*transport.Delivery]bool{}
	for d := range lost {
		settled[d] = true
		if work.Err() == nil {
			// Its stored copy is not safe yet: the broker redelivers it and
			// the pipeline decides again.
			_ = d.Ref.(*amqp.Delivery).Nack(false, true)
		}
	}
	for _, f := range native {
		if !settled[f.D] {
			settled[f.D] = true
			// The handler's text cannot travel with a native nack; the
			// pipeline logged it with the motiu.
			_ = f.D.Ref.(*amqp.Delivery).Nack(false, false)
		}
	}
	if !s.set.AtMostOnce {
		for _, f := range moved {
			if !settled[f.D] {
				settled[f.D] = true
				_ = f.D.Ref.(*amqp.Delivery).Ack(false)
			}
		}
	}
}

// storedDelivery is the AMQP delivery a copy of a stored message
// (Settlement.Copy) is made from: its headers (clau carrying the key) and
// body.
func storedDelivery(c *transport.Delivery) *amqp.Delivery {
	h := amqp.Table{}
	for _, x := range c.Headers {
		h[x.Key] = x.Value
	}
	if len(c.Key) > 0 {
		h[HeaderKey] = string(c.Key)
	}
	return &amqp.Delivery{Headers: h, Body: c.Value, ContentType: "application/json", Timestamp: c.Timestamp,
		RoutingKey: c.Topic}
}

// deadLetterCopy publishes a copy of d with its motiu to the DLX (so it
// lands in <queue>.dlq), confirmed. It reports whether the copy went.
func (s *Source) deadLetterCopy(ctx context.Context, d *amqp.Delivery, q consumedQueue, f *transport.Settlement) bool {
	// particio routed the original to its shard; particio_original keeps it.
	h := s.copyHeaders(d, q, f, contract.Failure{Dead: true, Reason: f.Reason})
	h[HeaderOriginQueue] = q.name
	return s.publishCopy(ctx, d, q, s.cfg.DLX, s.cfg.Queue, h)
}

// retryCopy publishes a copy of d to the wait queue of its delay,
// confirmed. It reports whether the copy went.
func (s *Source) retryCopy(ctx context.Context, d *amqp.Delivery, q consumedQueue, f *transport.Settlement) bool {
	delay := max(f.Delay, time.Millisecond)
	if err := s.declareWait(ctx, q.name, delay); err != nil {
		s.log.Error("amqp: cannot declare wait queue; dead-lettering natively", "queue", q.name, "err", err)
		s.deadInstead(f, err)
		return false
	}
	h := s.copyHeaders(d, q, f, contract.Failure{NotBefore: f.NotBefore})
	return s.publishCopy(ctx, d, q, "", contract.WaitQueueName(q.name, delay), h)
}

// copyHeaders returns the headers of the retry or DLQ copy of d, as the
// Kafka source writes them (contract.CopyHeaders): d's own without the
// headers RabbitMQ owns (x-*), particio (the copy goes to its queue by name)
// and the copy headers, then the copy headers of cf. A copy names the work
// queue it came from (topic_original), its shard (particio_original),
// offset_original -1 (a queue has no offsets), the queue as grup_consumidor
// and the message's AMQP timestamp as data_original.
func (s *Source) copyHeaders(d *amqp.Delivery, q consumedQueue, f *transport.Settlement, cf contract.Failure) amqp.Table {
	h := copyHeaders(d.Headers, contract.HeaderPartition)
	for k := range h {
		if contract.IsCopyHeader(k) {
			delete(h, k)
		}
	}
	cf.Attempt, cf.LastError, cf.Now = f.D.Attempt, f.LastError, time.Now()
	cf.Origin, cf.Partition, cf.Offset, cf.Timestamp, cf.Group = f.D.Origin, int32(q.shard), -1, d.Timestamp, s.cfg.Queue
	cf.Prior = func(k string) string { return priorHeader(d.Headers, k) }
	for _, x := range contract.CopyHeaders(cf) {
		h[x.Key] = x.Value
	}
	return h
}

// priorHeader renders header k of t as text for contract.CopyHeaders: an
// AMQP timestamp in the one time encoding, any other scalar as
// headerString does, "" for what is missing or no scalar.
func priorHeader(t amqp.Table, k string) string {
	if ts, ok := t[k].(time.Time); ok {
		if ts.IsZero() {
			return ""
		}
		return contract.FormatTime(ts)
	}
	v, _ := headerString(t[k])
	return v
}

// errNoCopy: the retry copy could not be published.
var errNoCopy = errors.New("retry copy not published")

// deadInstead turns a retry whose copy could not be made into a native
// dead letter, so that the message never loops.
func (s *Source) deadInstead(f *transport.Settlement, cause error) {
	if !f.Dead {
		f.Dead = true
		f.Reason = outcome.Truncate(contract.ReasonExhausted+"could not schedule the retry ("+cause.Error()+"): "+f.LastError, 200)
	}
}

// publishCopy publishes a copy of d with headers h, confirmed. If the copy
// cannot be published (publishRawRetry gave up), the settlement becomes a
// native dead letter (the caller nacks d without requeue, so that it never
// loops; if the channel is gone, that nack fails and the broker redelivers
// d). It reports whether the copy went.
func (s *Source) publishCopy(ctx context.Context, d *amqp.Delivery, q consumedQueue, exchange, key string, h amqp.Table) bool {
	err := s.pub.publishRawRetry(ctx, exchange, key, republish(d, h))
	if err == nil {
		return true
	}
	if ctx.Err() != nil {
		return false // shutting down: left unacked, redelivered
	}
	s.log.Error("amqp: cannot move message; dead-lettering natively", "queue", q.name,
		"message_id", d.MessageId, "to_exchange", exchange, "to_key", key, "err", err)
	return false
}

// declareWait declares the wait queue of queue for delay, at most once per
// connection and per quarter of its expiry.
func (s *Source) declareWait(ctx context.Context, queue string, delay time.Duration) error {
	name := contract.WaitQueueName(queue, delay)
	gen := s.cfg.Conn.generation()
	s.waitMu.Lock()
	w, ok := s.declared[name]
	s.waitMu.Unlock()
	if ok && w.gen == gen && time.Since(w.at) < s.cfg.WaitQueueExpiry/4 {
		return nil
	}
	t := Topology{Queues: []Queue{waitQueue(queue, delay, s.cfg.WaitQueueExpiry)}}
	if err := s.cfg.Conn.Do(ctx, func(ch *amqp.Channel) error { return t.apply(ctx, ch) }); err != nil {
		return err
	}
	s.waitMu.Lock()
	s.declared[name] = waitDecl{gen: gen, at: time.Now()}
	s.waitMu.Unlock()
	return nil
}

func randomTag() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Span names a delivery in the consumer's trace span: the queue it was read
// from (origin) and its routing key (topic); RabbitMQ has no consumer
// groups, so the group is the consumer's name.
func (s *Source) Span(topic, origin string) transport.SpanNames {
	return transport.SpanNames{System: "rabbitmq", Destination: origin, RoutingKey: topic}
}

// Validate reports nothing: NewSource checked the configuration.
func (s *Source) Validate() error { return nil }

// KeyOrder reports whether a key's messages reach one lane in their order
// (consumer.PerKey relies on it): in ordered mode (Shards > 1, one active
// consumer per shard queue, ShardedPublisher routing by key) or on a plain
// queue with one worker. A plain queue with several workers hands a key's
// messages to whichever worker is free.
func (s *Source) KeyOrder() error {
	if s.cfg.Shards > 1 || s.cfg.Workers == 1 {
		return nil
	}
	return errors.New("amqp: source: a plain queue with several workers keeps no order per key; use Shards (ordered mode, with amqp.ShardedPublisher) or Workers: 1")
}
