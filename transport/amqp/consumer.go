package amqp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
)

// Defaults of ConsumerConfig (the retry defaults are Kafka's, CONTRACT.md).
const (
	MaxAttemptsDefault     = 3
	BackoffBaseDefault     = time.Second
	BackoffMaxDefault      = time.Hour
	WaitQueueExpiryDefault = 30 * time.Minute
	StandbyDelayDefault    = 2 * time.Second
	ConsumerWorkersDefault = 4
)

// atMostOnceGrace bounds how long an acked AtMostOnce delivery may still run
// once Run's ctx ended (consumer.ShutdownTimeoutDefault, as on Kafka).
const atMostOnceGrace = consumer.ShutdownTimeoutDefault

// ConsumerConfig configures a Consumer.
type ConsumerConfig struct {
	Conn  *Conn  // required
	Queue string // required: the work queue, e.g. "inventari.comandes"

	// Exchange and RoutingKeys bind the work queue (each shard queue in
	// ordered mode, with key <routing key>.<i>) to Exchange, declared durable
	// of kind ExchangeKind (default "topic"). Empty Exchange: no binding;
	// publishers then use the default exchange with the queue name as key.
	Exchange     string
	ExchangeKind string
	RoutingKeys  []string

	// Shards > 1 selects ordered mode: queues <Queue>.<i>, i < Shards, each
	// with x-single-active-consumer and one worker; publishers route with
	// ShardedPublisher (hash(key) mod Shards). Every instance consumes all
	// shards; the broker lets one consumer per shard be active.
	Shards int
	// Instance and Instances spread the active shards in ordered mode: the
	// instance subscribes first to shards i with i % Instances == Instance and
	// to the others StandbyDelay later (RabbitMQ makes the first consumer of a
	// queue the active one). Instances 0: subscribe to all at once.
	Instance, Instances int
	StandbyDelay        time.Duration // default 2 s

	// Prefetch per channel (one channel per queue). Default 32.
	Prefetch int
	// Workers per queue for a plain queue (order is not kept between them).
	// Default 4. Ordered mode always uses 1 per shard.
	Workers int

	DLX string // default "km0.dlx"
	// MaxAttempts is the number of attempts in all, default 3. A copy's
	// intents is read within it (contract.Attempt).
	MaxAttempts int
	BackoffBase time.Duration // delay before attempt n+1 is base×2^(n−1); default 1 s
	// BackoffMax caps the delay, a RetryAfter delay too; default 1 h.
	BackoffMax      time.Duration
	WaitQueueExpiry time.Duration // x-expires of idle wait queues beyond their TTL; default 30 min

	// Classifier decides unclassified handler errors. Default
	// outcome.DefaultClassifier (transient).
	Classifier outcome.Classifier

	Pool    inbox.Beginner // required: the effect's database
	Inbox   *inbox.Inbox   // default: CONTRACT.md's public.missatges_processats
	Name    string         // required: consumidor, e.g. "inventari.descompte_estoc"
	Handler consumer.Handler
	// Types, when set, are the tipus the handler takes; others are acked and
	// counted as ignored, on the tipus header before decoding when it is
	// unambiguous. A delivery whose tipus header disagrees with the envelope
	// is dead-lettered (permanent, motiu logged), whatever Types holds.
	Types   []string
	Mode    consumer.Mode
	Decoder envelope.Decoder
	Logger  *slog.Logger
}

func (c ConsumerConfig) withDefaults() ConsumerConfig {
	if c.ExchangeKind == "" {
		c.ExchangeKind = amqp.ExchangeTopic
	}
	if c.StandbyDelay <= 0 {
		c.StandbyDelay = StandbyDelayDefault
	}
	if c.Prefetch <= 0 {
		c.Prefetch = PrefetchDefault
	}
	if c.Workers <= 0 {
		c.Workers = ConsumerWorkersDefault
	}
	if c.DLX == "" {
		c.DLX = DLXDefault
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = MaxAttemptsDefault
	}
	if c.BackoffBase <= 0 {
		c.BackoffBase = BackoffBaseDefault
	}
	if c.BackoffMax <= 0 {
		c.BackoffMax = BackoffMaxDefault
	}
	if c.WaitQueueExpiry <= 0 {
		c.WaitQueueExpiry = WaitQueueExpiryDefault
	}
	if c.Inbox == nil {
		c.Inbox = inbox.New(inbox.Config{})
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c ConsumerConfig) validate() error {
	switch {
	case c.Conn == nil:
		return errors.New("amqp: consumer: Conn is required")
	case c.Queue == "":
		return errors.New("amqp: consumer: Queue is required")
	case c.Pool == nil:
		return errors.New("amqp: consumer: Pool is required")
	case c.Name == "":
		return errors.New("amqp: consumer: Name (consumidor) is required")
	case inbox.CheckConsumer(c.Name) != nil:
		return fmt.Errorf("amqp: consumer: Name: %w", inbox.CheckConsumer(c.Name))
	case c.Handler == nil:
		return errors.New("amqp: consumer: Handler is required")
	case c.Shards > 1 && c.Instances > 0 && (c.Instance < 0 || c.Instance >= c.Instances):
		return fmt.Errorf("amqp: consumer: Instance %d out of range [0, %d)", c.Instance, c.Instances)
	}
	return nil
}

// Stats counts what a Consumer did.
type Stats struct {
	Processed    int64 // effect committed
	Duplicates   int64 // key already recorded: acked without the effect
	Ignored      int64 // tipus not in Types
	Retried      int64 // moved to a wait queue
	DeadLettered int64 // moved to the DLQ (native nack or exhausted copy)
	Failures     int64 // handler attempts that failed
}

// Consumer runs a consumer.Handler on the deliveries of a work queue (or of
// the shard queues of ordered mode). For each delivery it decodes the
// envelope, records (id_esdeveniment, Name) with package inbox and runs the
// handler in the same transaction, and acks only after the commit
// (AtLeastOnce). Failures:
//
//   - permanent (outcome.Permanent, undecodable envelope, a tipus header
//     that disagrees with it): basic.nack with requeue=false, so RabbitMQ
//     dead-letters it to <queue>.dlq at once;
//   - transient, attempts left: a copy with intents = attempt goes to the
//     wait queue <queue>.espera.<ms>, whose TTL dead-letters it back to the
//     work queue; the original is acked after the copy is confirmed;
//   - transient, attempts exhausted: a copy with motiu "transitori esgotat: …"
//     is published to km0.dlx (so it lands in <queue>.dlq with its reason) and
//     the original is acked after the confirm.
//
// requeue=true is never used.
type Consumer struct {
	cfg    ConsumerConfig
	pub    *Publisher
	queues []consumedQueue
	topo   Topology

	waitMu   sync.Mutex
	declared map[string]waitDecl

	processed, duplicates, ignored, retried, dead, failures atomic.Int64
}

type consumedQueue struct {
	name  string
	shard int
}

type waitDecl struct {
	gen uint64
	at  time.Time
}

// NewConsumer validates cfg, declares the topology (registered on the Conn
// for reconnects) and returns the Consumer. It does not consume until Run.
func NewConsumer(ctx context.Context, cfg ConsumerConfig) (*Consumer, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	c := &Consumer{cfg: cfg, declared: map[string]waitDecl{}}
	var topo Topology
	if cfg.Exchange != "" {
		topo.Exchanges = append(topo.Exchanges, Exchange{Name: cfg.Exchange, Kind: cfg.ExchangeKind, Durable: true})
	}
	if cfg.Shards > 1 {
		for i := range cfg.Shards {
			name := ShardQueueName(cfg.Queue, i)
			topo = topo.Merge(WorkQueueTopology(cfg.DLX, name, cfg.Queue, true))
			if cfg.Exchange != "" {
				for _, k := range cfg.RoutingKeys {
					topo.Bindings = append(topo.Bindings, Binding{Queue: name, Exchange: cfg.Exchange, Key: k + "." + strconv.Itoa(i)})
				}
			}
			c.queues = append(c.queues, consumedQueue{name: name, shard: i})
		}
	} else {
		topo = topo.Merge(WorkQueueTopology(cfg.DLX, cfg.Queue, cfg.Queue, false))
		if cfg.Exchange != "" {
			for _, k := range cfg.RoutingKeys {
				topo.Bindings = append(topo.Bindings, Binding{Queue: cfg.Queue, Exchange: cfg.Exchange, Key: k})
			}
		}
		c.queues = []consumedQueue{{name: cfg.Queue}}
	}
	if err := cfg.Conn.Declare(ctx, topo); err != nil {
		return nil, err
	}
	c.topo = topo
	pub, err := NewPublisher(ctx, cfg.Conn, PublisherConfig{Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	c.pub = pub
	return c, nil
}

// Queues returns every queue the consumer declared: work (or shard) queues,
// the DLQ and the wait queues used so far.
func (c *Consumer) Queues() []string {
	out := c.topo.QueueNames()
	c.waitMu.Lock()
	for q := range c.declared {
		out = append(out, q)
	}
	c.waitMu.Unlock()
	slices.Sort(out)
	return slices.Compact(out)
}

// Stats returns the counters so far.
func (c *Consumer) Stats() Stats {
	return Stats{Processed: c.processed.Load(), Duplicates: c.duplicates.Load(), Ignored: c.ignored.Load(),
		Retried: c.retried.Load(), DeadLettered: c.dead.Load(), Failures: c.failures.Load()}
}

// Run consumes until ctx ends, then lets the deliveries in hand finish and
// returns nil. Connection failures are healed inside (Conn.Subscribe). It
// returns an error only if the Conn is closed.
func (c *Consumer) Run(ctx context.Context) error {
	defer c.pub.Close() //nolint:errcheck // best effort
	var wg sync.WaitGroup
	errs := make(chan error, len(c.queues))
	for _, q := range c.queues {
		workers := c.cfg.Workers
		var delay time.Duration
		if c.cfg.Shards > 1 {
			workers = 1
			if c.cfg.Instances > 0 && q.shard%c.cfg.Instances != c.cfg.Instance {
				delay = c.cfg.StandbyDelay
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if delay > 0 {
				select {
				case <-time.After(delay):
				case <-ctx.Done():
					return
				}
			}
			sc := SubscribeConfig{Queue: q.name, Prefetch: c.cfg.Prefetch, Workers: workers, Logger: c.cfg.Logger}
			if err := c.cfg.Conn.Subscribe(ctx, sc, func(ctx context.Context, d *amqp.Delivery) { c.handle(ctx, q, d) }); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// handle processes one delivery to the end: ack, nack or move.
func (c *Consumer) handle(ctx context.Context, q consumedQueue, d *amqp.Delivery) {
	log := c.cfg.Logger
	// A copy back from a wait queue carries intents; it is trusted no
	// further than MaxAttempts (contract.Attempt). No header: attempt 1.
	attempt := 1
	if v, ok := d.Headers[transport.HeaderAttempts]; ok {
		s, _ := headerString(v)
		attempt = contract.Attempt(s, c.cfg.MaxAttempts)
	}
	// Filter on the tipus header before decoding, as on Kafka, but only on
	// an unambiguous one; one that disagrees with the envelope is a
	// permanent failure, never a silent skip.
	th := typeHeader(d.Headers)
	if t, ok := th.Filter(); ok && !c.handles(t) {
		c.ignored.Add(1)
		_ = d.Ack(false)
		return
	}
	env, err := c.cfg.Decoder.Decode(d.Body)
	if errors.Is(err, outcome.ErrIgnore) {
		c.ignored.Add(1)
		_ = d.Ack(false)
		return
	}
	if err == nil {
		if terr := th.Check(env.Type); terr != nil {
			err = outcome.Permanent(terr)
		}
	}
	if err != nil {
		c.failures.Add(1)
		c.deadLetterNative(d, q, err)
		return
	}
	if !c.handles(env.Type) {
		c.ignored.Add(1)
		_ = d.Ack(false)
		return
	}
	m := &consumer.Message{Message: FromDelivery(d), Partition: int32(q.shard), Offset: -1, Envelope: env, Attempt: attempt,
		IdempotencyKey: consumer.IdempotencyKey(env)}
	m.FirstFailure, _ = headerTime(d.Headers, HeaderFirstFailure)
	if c.cfg.Mode == consumer.AtMostOnce {
		if ctx.Err() != nil {
			// Stopping: ack nothing new. Unacked, the broker requeues it.
			return
		}
		// Ack first: a crash from here on loses the message, by choice. A
		// clean stop does not: the acked message is handled to the end with
		// a context the stop cancels only after atMostOnceGrace.
		_ = d.Ack(false)
		hctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		defer cancel()
		defer context.AfterFunc(ctx, func() {
			select {
			case <-time.After(atMostOnceGrace):
				cancel()
			case <-hctx.Done():
			}
		})()
		if _, err := c.cfg.Inbox.Process(hctx, c.cfg.Pool, c.cfg.Name, m.IdempotencyKey, func(tx pgx.Tx) error { return c.run(hctx, tx, m) }); err != nil {
			c.failures.Add(1)
			log.Warn("amqp: at-most-once message failed and is dropped", "queue", q.name, "id_esdeveniment", env.ID, "err", err)
		} else {
			c.processed.Add(1)
		}
		return
	}
	var res inbox.Result
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		res, err = c.cfg.Inbox.Process(ctx, c.cfg.Pool, c.cfg.Name, m.IdempotencyKey, func(tx pgx.Tx) error { return c.run(ctx, tx, m) })
		if !errors.Is(err, inbox.ErrStore) || ctx.Err() != nil {
			break
		}
		// The database, not the message, failed (e.g. a restart): try the
		// same delivery again in place, unacked, without spending one of its
		// attempts, so an outage never walks healthy messages to the DLQ.
		log.Warn("amqp: database unavailable; retrying in place", "queue", q.name, "id_esdeveniment", env.ID, "err", err, "retry_in", wait)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	if err == nil {
		// The effect is committed: ack now. A lost ack redelivers the
		// message, and the recorded key turns it into a duplicate.
		_ = d.Ack(false)
		if res == inbox.Duplicate {
			c.duplicates.Add(1)
		} else {
			c.processed.Add(1)
		}
		return
	}
	if ctx.Err() != nil {
		// Shutting down: not a failure of the message. Leave it unacked; the
		// broker requeues it when the channel closes.
		return
	}
	c.failures.Add(1)
	kind, delay := outcome.Classify(err, c.cfg.Classifier)
	if kind == outcome.KindPermanent {
		c.deadLetterNative(d, q, err)
		return
	}
	if attempt >= c.cfg.MaxAttempts {
		c.deadLetterExhausted(ctx, d, q, attempt, err)
		return
	}
	if delay <= 0 {
		delay = c.backoff(attempt)
	}
	c.retry(ctx, d, q, attempt, min(delay, c.cfg.BackoffMax), err)
}

func (c *Consumer) handles(tipus string) bool {
	return len(c.cfg.Types) == 0 || slices.Contains(c.cfg.Types, tipus)
}

// typeHeader reads the tipus header of a delivery. An AMQP table holds one
// value per name, but of any type: one that is not a string (or bytes)
// makes the header ambiguous.
func typeHeader(t amqp.Table) contract.TypeHeader {
	var th contract.TypeHeader
	switch v := t[transport.HeaderType].(type) {
	case nil:
		if _, ok := t[transport.HeaderType]; ok {
			th.Add("")
		}
	case string:
		th.Add(v)
	case []byte:
		th.Add(string(v))
	default:
		s, _ := headerString(v)
		th.AddNotText(fmt.Sprintf("%s (%T)", s, v))
	}
	return th
}

// run calls the handler, turning a panic into a transient error.
func (c *Consumer) run(ctx context.Context, tx pgx.Tx, m *consumer.Message) (err error) {
	// Tracing: the consumer span of this attempt, the child of the trace
	// context the message carries.
	ctx, span := tracing.ConsumerContext(ctx, m.Message, tracing.Delivery{System: tracing.SystemRabbitMQ,
		Destination: c.cfg.Queue, Group: c.cfg.Name, MessageID: m.Envelope.ID, RoutingKey: m.Topic})
	m.SetContext(ctx)
	defer func() { tracing.End(span, err) }() // after the recover below
	defer func() {
		if r := recover(); r != nil {
			c.cfg.Logger.Error("amqp: handler panicked", "id_esdeveniment", m.Envelope.ID, "panic", r, "stack", string(debug.Stack()))
			err = outcome.Transient(fmt.Errorf("panic: %v", r))
		}
	}()
	return c.cfg.Handler(ctx, tx, m)
}

// backoff is base × 2^(attempt−1), capped.
func (c *Consumer) backoff(attempt int) time.Duration {
	return outcome.Backoff(c.cfg.BackoffBase, c.cfg.BackoffMax, attempt)
}

// deadLetterNative rejects without requeue: RabbitMQ moves the message to
// <queue>.dlq through km0.dlx and adds x-death (reason "rejected"). The
// handler's text cannot travel with a native nack; it is logged here.
func (c *Consumer) deadLetterNative(d *amqp.Delivery, q consumedQueue, err error) {
	c.dead.Add(1)
	c.cfg.Logger.Error("amqp: dead letter (permanent)", "queue", q.name, "dlq", DLQName(c.cfg.Queue),
		"message_id", d.MessageId, "motiu", outcome.Reason(outcome.KindPermanent, err))
	_ = d.Nack(false, false)
}

// deadLetterExhausted publishes a copy with its reason to the DLQ, then acks.
func (c *Consumer) deadLetterExhausted(ctx context.Context, d *amqp.Delivery, q consumedQueue, attempt int, err error) {
	h := copyHeaders(d.Headers, transport.HeaderNotBefore)
	h[transport.HeaderAttempts] = int64(attempt)
	h[transport.HeaderReason] = outcome.Reason(outcome.KindTransient, err)
	h[transport.HeaderLastError] = outcome.Truncate(err.Error(), 200)
	h[HeaderOriginQueue] = q.name
	now := time.Now()
	h[HeaderDeadAt] = contract.FormatTime(now)
	h[HeaderFirstFailure] = firstFailure(d.Headers, now)
	if !c.move(ctx, d, q, c.cfg.DLX, c.cfg.Queue, h) {
		return
	}
	c.dead.Add(1)
	c.cfg.Logger.Error("amqp: dead letter (attempts exhausted)", "queue", q.name, "dlq", DLQName(c.cfg.Queue),
		"message_id", d.MessageId, "intents", attempt, "motiu", h[transport.HeaderReason])
}

// retry publishes a copy to the wait queue for delay, then acks.
func (c *Consumer) retry(ctx context.Context, d *amqp.Delivery, q consumedQueue, attempt int, delay time.Duration, err error) {
	delay = max(delay, time.Millisecond)
	if derr := c.declareWait(ctx, q.name, delay); derr != nil {
		c.cfg.Logger.Error("amqp: cannot declare wait queue; dead-lettering natively", "queue", q.name, "err", derr)
		c.deadLetterNative(d, q, err)
		return
	}
	h := copyHeaders(d.Headers)
	h[transport.HeaderAttempts] = int64(attempt)
	h[transport.HeaderLastError] = outcome.Truncate(err.Error(), 200)
	now := time.Now()
	h[transport.HeaderNotBefore] = contract.FormatTime(now.Add(delay))
	h[HeaderFirstFailure] = firstFailure(d.Headers, now)
	if c.move(ctx, d, q, "", WaitQueueName(q.name, delay), h) {
		c.retried.Add(1)
		c.cfg.Logger.Info("amqp: retry scheduled", "queue", q.name, "message_id", d.MessageId, "intents", attempt, "delay", delay, "err", err)
	}
}

// firstFailure is the primera_fallada of a copy of a delivery that failed
// at now: the delivery's own, in the one encoding whatever encoding it came
// in, else (a first failure, or a value that is no time) now.
func firstFailure(t amqp.Table, now time.Time) string {
	if ff, ok := headerTime(t, HeaderFirstFailure); ok {
		return contract.FormatTime(ff)
	}
	return contract.FormatTime(now)
}

// move publishes a copy of d with headers h, confirmed, and then acks d. If
// the copy cannot be published (PublishRawRetry), d is rejected without
// requeue (native DLQ) so that it never loops; if the channel is gone, that
// nack fails and the broker redelivers d. It reports whether the copy went.
func (c *Consumer) move(ctx context.Context, d *amqp.Delivery, q consumedQueue, exchange, key string, h amqp.Table) bool {
	err := c.pub.PublishRawRetry(ctx, exchange, key, republish(d, h))
	if err == nil {
		_ = d.Ack(false)
		return true
	}
	if ctx.Err() != nil {
		return false // shutting down: left unacked, redelivered
	}
	c.cfg.Logger.Error("amqp: cannot move message; dead-lettering natively", "queue", q.name,
		"message_id", d.MessageId, "to_exchange", exchange, "to_key", key, "err", err)
	c.dead.Add(1)
	_ = d.Nack(false, false)
	return false
}

// declareWait declares the wait queue of queue for delay, at most once per
// connection and per quarter of its expiry.
func (c *Consumer) declareWait(ctx context.Context, queue string, delay time.Duration) error {
	name := WaitQueueName(queue, delay)
	gen := c.cfg.Conn.Generation()
	c.waitMu.Lock()
	w, ok := c.declared[name]
	c.waitMu.Unlock()
	if ok && w.gen == gen && time.Since(w.at) < c.cfg.WaitQueueExpiry/4 {
		return nil
	}
	t := Topology{Queues: []Queue{waitQueue(queue, delay, c.cfg.WaitQueueExpiry)}}
	if err := c.cfg.Conn.Do(ctx, func(ch *amqp.Channel) error { return t.apply(ctx, ch) }); err != nil {
		return err
	}
	c.waitMu.Lock()
	c.declared[name] = waitDecl{gen: gen, at: time.Now()}
	c.waitMu.Unlock()
	return nil
}

func randomTag() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
