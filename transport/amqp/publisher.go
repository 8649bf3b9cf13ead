package amqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
)

// MaxMessageBytesDefault is RabbitMQ 4.x's default max_message_size (16 MiB;
// 3.x allowed 128 MiB). A larger body closes the publishing channel on a 4.x
// broker at every attempt, so it is refused before sending unless
// PublisherConfig.MaxMessageBytes is raised to the broker's setting.
const MaxMessageBytesDefault = 16 << 20

// Errors of Publish.
var (
	// ErrUnroutable: the broker returned the message (mandatory flag): no
	// queue is bound for its routing key. See ReturnedError.
	ErrUnroutable = errors.New("amqp: message unroutable (returned by the broker)")
	// ErrNacked: the broker refused the message with basic.nack (an internal
	// broker error); publishing it again may succeed.
	ErrNacked = errors.New("amqp: message nacked by the broker")
	// ErrChannelLost: the channel or connection closed before the broker
	// confirmed the message; nothing is known about it.
	ErrChannelLost = errors.New("amqp: channel closed before the confirm")
)

// ReturnedError lists the messages of one publish the broker returned as
// unroutable. errors.Is(err, ErrUnroutable) is true. It is deliberately not a
// *transport.RejectedError: a missing binding is a topology gap that heals
// when the queue is declared, so callers such as the relay keep the messages
// and publish them again instead of parking them.
type ReturnedError struct {
	Index   []int         // positions in the published slice
	Returns []amqp.Return // the broker's basic.return for each
}

func (e *ReturnedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "amqp: %d message(s) returned unroutable", len(e.Index))
	for i := range e.Index {
		if i == 3 {
			b.WriteString("; …")
			break
		}
		r := e.Returns[i]
		fmt.Fprintf(&b, "; #%d exchange %q routing key %q: %d %s", e.Index[i], r.Exchange, r.RoutingKey, r.ReplyCode, r.ReplyText)
	}
	return b.String()
}

// Is makes errors.Is(err, ErrUnroutable) true.
func (e *ReturnedError) Is(target error) bool { return target == ErrUnroutable }

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// Exchange receives every message, with Message.Topic as routing key.
	// Default "": the default exchange, where the routing key names a queue.
	Exchange string
	// ExchangeKind is used to declare Exchange (durable). Default "topic".
	// Exchanges named amq.* are predeclared and not declared again.
	ExchangeKind string
	// ContentType of published messages. Default "application/json".
	ContentType string
	// MaxMessageBytes: larger messages are not sent and are reported in a
	// *transport.RejectedError. Default MaxMessageBytesDefault (16 MiB); set
	// it to the broker's max_message_size if that was raised.
	MaxMessageBytes int
	// Logger. Default: the Conn's.
	Logger *slog.Logger
}

// Publisher publishes with publisher confirms and the mandatory flag, as
// persistent messages, on one channel of a Conn. It implements
// transport.Publisher. Many goroutines may publish at once; a publish waits
// only for its own confirms. When the channel dies (connection lost) the
// messages in flight fail with ErrChannelLost and the next publish opens a
// new channel, waiting for the Conn to reconnect.
type Publisher struct {
	conn *Conn
	cfg  PublisherConfig

	sem chan struct{} // held while the channel is checked or replaced
	pc  *pubChannel
}

var _ transport.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher on conn. It declares cfg.Exchange (and
// registers it for redeclaration after reconnects); a declaration error is
// returned.
func NewPublisher(ctx context.Context, conn *Conn, cfg PublisherConfig) (*Publisher, error) {
	p := newPublisher(conn, cfg)
	if p.cfg.Exchange != "" {
		t := Topology{Exchanges: []Exchange{{Name: p.cfg.Exchange, Kind: p.cfg.ExchangeKind, Durable: true}}}
		if err := conn.Declare(ctx, t); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// Exchange returns the exchange p publishes to: PublisherConfig.Exchange,
// "" for the default exchange.
func (p *Publisher) Exchange() string { return p.cfg.Exchange }

// newPublisher fills in cfg's defaults; it declares nothing.
func newPublisher(conn *Conn, cfg PublisherConfig) *Publisher {
	if cfg.ExchangeKind == "" {
		cfg.ExchangeKind = amqp.ExchangeTopic
	}
	if cfg.ContentType == "" {
		cfg.ContentType = ContentTypeJSON
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = MaxMessageBytesDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = conn.log
	}
	return &Publisher{conn: conn, cfg: cfg, sem: make(chan struct{}, 1)}
}

// Check reports a message the broker would refuse for good: a body over
// MaxMessageBytes, or a short string (routing key, property, header name)
// over 255 bytes. Publish refuses such a message unsent (transport.Checker).
func (p *Publisher) Check(m *transport.Message) error {
	_, err := p.check(m)
	return err
}

func (p *Publisher) check(m *transport.Message) (amqp.Publishing, error) {
	if len(m.Value) > p.cfg.MaxMessageBytes {
		return amqp.Publishing{}, fmt.Errorf("amqp: %d bytes, over the limit of %d", len(m.Value), p.cfg.MaxMessageBytes)
	}
	pub := toPublishing(m, p.cfg.ContentType)
	if err := checkShortStrings(p.cfg.Exchange, m.Topic, &pub); err != nil {
		return amqp.Publishing{}, err
	}
	return pub, nil
}

// Publish implements transport.Publisher: it publishes msgs to the
// configured exchange (routing key Message.Topic) and returns nil only when
// the broker confirmed every one and returned none. A message over
// MaxMessageBytes, or with a short string (routing key, message_id, type, a
// header name) over AMQP's 255 bytes, is not sent and is listed in a
// *transport.RejectedError (when everything else was confirmed). Returned messages give a
// *ReturnedError; a nack, a lost channel or ctx ending give another error:
// then nothing is known about any message and the caller publishes them
// again (at-least-once; the same id_esdeveniment lets consumers drop the
// duplicates). The trace of ctx, if any, is added to the headers of what is
// sent (traceparent/tracestate), not to msgs.
func (p *Publisher) Publish(ctx context.Context, msgs []*transport.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	pubs := make([]amqp.Publishing, 0, len(msgs))
	keys := make([]string, 0, len(msgs))
	index := make([]int, 0, len(msgs))
	var rejected *transport.RejectedError
	traced := trace.SpanContextFromContext(ctx).IsValid()
	for i, m := range msgs {
		if traced {
			// Carry the caller's trace to the consumer (T1), without
			// writing into the caller's message.
			c := *m
			c.Headers = slices.Clone(m.Headers)
			tracing.Inject(ctx, &c)
			m = &c
		}
		pub, err := p.check(m)
		if err != nil {
			if rejected == nil {
				rejected = &transport.RejectedError{}
			}
			rejected.Index = append(rejected.Index, i)
			rejected.Errs = append(rejected.Errs, err)
			continue
		}
		pubs = append(pubs, pub)
		keys = append(keys, m.Topic)
		index = append(index, i)
	}
	if err := p.publish(ctx, p.cfg.Exchange, keys, pubs, index); err != nil {
		return err
	}
	if rejected != nil {
		return rejected
	}
	return nil
}

// PublishRaw publishes msgs to exchange with routing key key, mandatory and
// confirmed, exactly as given (delivery mode and properties are the
// caller's; an empty MessageId gets a random one). A short string over 255
// bytes is an error before anything is sent. It returns nil when all
// were confirmed, a *ReturnedError when some were returned, or another error
// when the outcome is unknown.
func (p *Publisher) PublishRaw(ctx context.Context, exchange, key string, msgs ...amqp.Publishing) error {
	keys := make([]string, len(msgs))
	index := make([]int, len(msgs))
	for i := range msgs {
		keys[i] = key
		index[i] = i
	}
	return p.publish(ctx, exchange, keys, msgs, index)
}

// publishRawRetry is PublishRaw of one message, tried up to 3 times (5 s
// each, 200 and 400 ms apart) while the outcome is unknown or nacked; a
// returned message (*ReturnedError) or the end of ctx stops it at once. It
// returns the last error.
func (p *Publisher) publishRawRetry(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	var err error
	for try := range 3 {
		if try > 0 {
			select {
			case <-time.After(time.Duration(try) * 200 * time.Millisecond):
			case <-ctx.Done():
				return errors.Join(ctx.Err(), err)
			}
		}
		tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = p.PublishRaw(tctx, exchange, key, msg)
		cancel()
		if err == nil || errors.Is(err, ErrUnroutable) || ctx.Err() != nil {
			return err
		}
	}
	return err
}

func (p *Publisher) publish(ctx context.Context, exchange string, keys []string, pubs []amqp.Publishing, index []int) error {
	if len(pubs) == 0 {
		return nil
	}
	for i := range pubs {
		if err := checkShortStrings(exchange, keys[i], &pubs[i]); err != nil {
			return err // nothing sent: the library would drop the connection
		}
	}
	pc, err := p.channel(ctx)
	if err != nil {
		return err
	}
	waits := make([]*pending, len(pubs))
	for i, m := range pubs {
		if m.MessageId == "" {
			m.MessageId = uuid.NewString() // basic.return frames are matched by it (and the route)
		}
		w, err := pc.publish(ctx, exchange, keys[i], m)
		if err != nil {
			return fmt.Errorf("amqp: publish to exchange %q key %q: %w", exchange, keys[i], err)
		}
		waits[i] = w
	}
	var returned *ReturnedError
	for i, w := range waits {
		select {
		case <-w.done:
		case <-ctx.Done():
			return fmt.Errorf("amqp: waiting for confirms: %w", ctx.Err())
		}
		switch {
		case w.err != nil:
			return w.err
		case w.ret != nil:
			if returned == nil {
				returned = &ReturnedError{}
			}
			returned.Index = append(returned.Index, index[i])
			returned.Returns = append(returned.Returns, *w.ret)
		case !w.ack:
			return fmt.Errorf("%w (exchange %q key %q)", ErrNacked, exchange, keys[i])
		}
	}
	if returned != nil {
		return returned
	}
	return nil
}

// channel returns the live confirm channel, opening one if needed (waiting,
// within ctx, for the Conn to reconnect).
func (p *Publisher) channel(ctx context.Context) (*pubChannel, error) {
	select {
	case p.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-p.sem }()
	if p.pc != nil && !p.pc.isDead() {
		return p.pc, nil
	}
	ch, err := p.conn.Channel(ctx)
	if err != nil {
		return nil, err
	}
	pc, err := newPubChannel(ch, p.cfg.Logger)
	if err != nil {
		_ = ch.Close()
		return nil, err
	}
	p.pc = pc
	return pc, nil
}

// Close closes the publisher's channel; publishes in flight fail with
// ErrChannelLost. The Conn stays open. The Publisher may be used again: a
// later Publish opens a new channel.
func (p *Publisher) Close() error {
	p.sem <- struct{}{}
	pc := p.pc
	p.pc = nil
	<-p.sem
	if pc != nil {
		return pc.ch.Close()
	}
	return nil
}

// pending is one published message waiting for its confirm.
type pending struct {
	tag      uint64
	id       string
	exchange string // with key, tells apart messages that share an id
	key      string
	done     chan struct{}
	ack      bool
	ret      *amqp.Return
	err      error
}

// pubChannel is a channel in confirm mode with one dispatcher goroutine that
// receives, in the order the connection's reader produced them, the returns
// (unbuffered listener: the reader hands a return over before it processes
// the ack that follows it) and the confirms (NotifyPublish). So a message's
// return is always recorded before its confirm completes it.
type pubChannel struct {
	ch     *amqp.Channel
	log    *slog.Logger
	sendMu sync.Mutex // serialises seq number + basic.publish

	mu      sync.Mutex
	pending map[uint64]*pending
	byID    map[string][]*pending
	dead    chan struct{}
	err     error
}

func newPubChannel(ch *amqp.Channel, log *slog.Logger) (*pubChannel, error) {
	if err := ch.Confirm(false); err != nil {
		return nil, fmt.Errorf("amqp: confirm mode: %w", err)
	}
	pc := &pubChannel{ch: ch, log: log, pending: map[uint64]*pending{}, byID: map[string][]*pending{}, dead: make(chan struct{})}
	returns := ch.NotifyReturn(make(chan amqp.Return))
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 4096))
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	go pc.dispatch(returns, confirms, closes)
	return pc, nil
}

func (pc *pubChannel) isDead() bool {
	select {
	case <-pc.dead:
		return true
	default:
		return false
	}
}

func (pc *pubChannel) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) (*pending, error) {
	pc.sendMu.Lock()
	defer pc.sendMu.Unlock()
	// The tag is read before pc.mu is taken (sendMu keeps it ours): the
	// library holds its sequence lock while it hands a burst of reordered
	// confirms to dispatch, which needs pc.mu for each, so waiting for that
	// lock while holding pc.mu would wedge the channel's confirms.
	w := &pending{id: msg.MessageId, exchange: exchange, key: key, done: make(chan struct{}), tag: pc.ch.GetNextPublishSeqNo()}
	pc.mu.Lock()
	if pc.err != nil {
		pc.mu.Unlock()
		return nil, pc.err
	}
	pc.pending[w.tag] = w
	pc.byID[w.id] = append(pc.byID[w.id], w)
	pc.mu.Unlock()
	if err := pc.ch.PublishWithContext(ctx, exchange, key, true, false, msg); err != nil {
		pc.mu.Lock()
		pc.forget(w)
		pc.mu.Unlock()
		return nil, err
	}
	return w, nil
}

// forget removes w from the maps; pc.mu held.
func (pc *pubChannel) forget(w *pending) {
	delete(pc.pending, w.tag)
	list := pc.byID[w.id]
	for i, x := range list {
		if x == w {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(pc.byID, w.id)
	} else {
		pc.byID[w.id] = list
	}
}

func (pc *pubChannel) dispatch(returns <-chan amqp.Return, confirms <-chan amqp.Confirmation, closes <-chan *amqp.Error) {
	var cause *amqp.Error
	for returns != nil || confirms != nil {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			pc.onReturn(r)
		case c, ok := <-confirms:
			if !ok {
				confirms = nil
				continue
			}
			pc.onConfirm(c)
		case e, ok := <-closes:
			if ok && e != nil {
				cause = e
			}
			closes = nil
		}
	}
	if cause == nil {
		select {
		case e := <-closes:
			cause = e
		default:
		}
	}
	err := ErrChannelLost
	if cause != nil {
		err = fmt.Errorf("%w: %w", ErrChannelLost, cause)
	}
	pc.mu.Lock()
	pc.err = err
	// Dead before any waiter wakes: a caller that sees its publish fail and
	// publishes again must get a new channel, not this one.
	close(pc.dead)
	for _, w := range pc.pending {
		w.err = err
		close(w.done)
	}
	pc.pending = nil
	pc.byID = nil
	pc.mu.Unlock()
}

func (pc *pubChannel) onReturn(r amqp.Return) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	for _, w := range pc.byID[r.MessageId] {
		if w.ret == nil && w.exchange == r.Exchange && w.key == r.RoutingKey {
			w.ret = &r
			return
		}
	}
	pc.log.Warn("amqp: basic.return for a message not in flight", "message_id", r.MessageId,
		"exchange", r.Exchange, "routing_key", r.RoutingKey, "reply", r.ReplyText)
}

func (pc *pubChannel) onConfirm(c amqp.Confirmation) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	w, ok := pc.pending[c.DeliveryTag]
	if !ok {
		return
	}
	pc.forget(w)
	w.ack = c.Ack
	close(w.done)
}
