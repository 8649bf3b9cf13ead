// Package amqprr is request/reply over RabbitMQ (CONTRACT.md): requests go
// through the default exchange to the server's queue
// (pagaments.autoritzacions) with reply_to = the client's exclusive,
// server-named queue and a fresh correlation_id; the server copies the
// correlation_id into its reply.
//
// Why an exclusive queue and not direct reply-to (amq.rabbitmq.reply-to):
// CONTRACT.md names the requester's exclusive queue, which a Python
// client also uses; a reply to it can be published with mandatory and
// confirmed, so the server learns when the client is gone (the reply is
// returned) instead of losing it silently; and it can be inspected with
// rabbitmqctl. Direct reply-to saves one queue per client and a declaration,
// which is negligible for a long-lived client; ClientConfig.DirectReplyTo
// selects it, and the Server answers both kinds of client.
package amqprr

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/amqp"
)

// ClientConfig configures a Client.
type ClientConfig struct {
	Conn *amqp.Conn // required
	// Timeout applies to a request whose context has no deadline.
	// Default requestreply.TimeoutDefault (5 s).
	Timeout time.Duration
	// Persistent publishes requests with delivery mode 2. Default false:
	// a request is only useful while its caller waits, and the exclusive reply
	// queue does not survive a broker restart either; the request queue is
	// durable, so a server restart loses no request.
	Persistent bool
	// DirectReplyTo makes replies come through RabbitMQ's direct reply-to
	// (reply_to amq.rabbitmq.reply-to) instead of an exclusive queue: no
	// queue to declare, but a server cannot tell that this client is gone
	// (see DirectReplyTo). Default false: the exclusive queue CONTRACT.md
	// names.
	DirectReplyTo bool
	// SigningKey, if set, signs every request (header
	// requestreply.HeaderSignature; see requestreply.Sign) for servers that
	// verify, and makes the client drop every reply not signed with it
	// (requestreply.SignReply): such a request waits on, for the server's
	// reply or its deadline. At least requestreply.MinKeyBytes, or NewClient
	// fails. Default none: requests go unsigned and any reply is taken.
	// Never logged.
	SigningKey []byte
	// Metrics, if set, receives requestreply.MetricRepliesDropped.
	Metrics prometheus.Registerer
	Logger  *slog.Logger // default slog.Default()
}

// Client is a requestreply.Requester over RabbitMQ. Many goroutines may call
// Request at once; each reply is matched to its request by correlation_id.
// A reply that arrives after its request timed out is dropped and counted
// (LateReplies); it is never delivered to another request. When the
// connection is lost, the requests waiting on it fail with
// requestreply.ErrConnectionLost, and the client declares a new reply queue
// once the Conn has reconnected.
type Client struct {
	cfg    ClientConfig
	log    *slog.Logger
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex
	sess    *session      // nil while (re)connecting
	changed chan struct{} // closed and replaced when sess changes

	ids    *requestreply.IDs
	late   atomic.Int64
	verify *requestreply.ReplyVerifier
}

var _ requestreply.Requester = (*Client)(nil)

// session is one reply queue consumed on one channel, and one channel to
// publish requests on (two channels: the broker runs each in its own
// process, so publishing and consuming proceed in parallel).
type session struct {
	ch      *amqp091.Channel // consumes the reply queue
	pub     *amqp091.Channel // publishes requests; returns arrive here
	replyTo string
	events  sessionEvents
	calls   *requestreply.Calls
}

// NewClient declares the client's reply queue and starts consuming it. An
// unreachable broker (the Conn waits for it) is bounded by ctx.
func NewClient(ctx context.Context, cfg ClientConfig) (*Client, error) {
	if cfg.Conn == nil {
		return nil, errors.New("amqprr: ClientConfig.Conn is required")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = requestreply.TimeoutDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	verify, err := requestreply.NewReplyVerifier(cfg.SigningKey, cfg.Metrics, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("amqprr: %w", err)
	}
	c := &Client{cfg: cfg, log: cfg.Logger, done: make(chan struct{}), changed: make(chan struct{}), ids: requestreply.NewIDs(), verify: verify}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	s, err := c.open(ctx)
	if err != nil {
		c.cancel()
		return nil, err
	}
	c.install(s)
	go c.loop(s)
	return c, nil
}

// sessionEvents are what a session's loop listens to.
type sessionEvents struct {
	deliveries <-chan amqp091.Delivery
	returns    <-chan amqp091.Return
	pubClosed  <-chan *amqp091.Error
}

// open declares a new exclusive reply queue and consumes it (no-ack: a reply
// is only useful to this process).
func (c *Client) open(ctx context.Context) (*session, error) {
	ch, err := c.cfg.Conn.Channel(ctx)
	if err != nil {
		return nil, err
	}
	pub, err := c.cfg.Conn.Channel(ctx)
	if err != nil {
		_ = ch.Close()
		return nil, err
	}
	s := &session{ch: ch, pub: pub, calls: requestreply.NewCalls(c.verify)}
	if c.cfg.DirectReplyTo {
		// RabbitMQ delivers direct replies to the channel that published
		// the request, so this one consumes them.
		s.replyTo = DirectReplyTo
		if s.events.deliveries, err = pub.Consume(DirectReplyTo, "", true, false, false, false, nil); err != nil {
			s.close()
			return nil, fmt.Errorf("amqprr: consume %s: %w", DirectReplyTo, err)
		}
		s.events.returns = pub.NotifyReturn(make(chan amqp091.Return, 16))
		s.events.pubClosed = pub.NotifyClose(make(chan *amqp091.Error, 1))
		return s, nil
	}
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		s.close()
		return nil, fmt.Errorf("amqprr: declare reply queue: %w", err)
	}
	s.replyTo = q.Name
	s.events.deliveries, err = ch.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		s.close()
		return nil, fmt.Errorf("amqprr: consume reply queue: %w", err)
	}
	s.events.returns = pub.NotifyReturn(make(chan amqp091.Return, 16))
	s.events.pubClosed = pub.NotifyClose(make(chan *amqp091.Error, 1))
	return s, nil
}

func (s *session) close() {
	_ = s.pub.Close()
	_ = s.ch.Close()
}

func (c *Client) install(s *session) {
	c.mu.Lock()
	c.sess = s
	close(c.changed)
	c.changed = make(chan struct{})
	c.mu.Unlock()
}

// loop matches replies until the session's channel dies, then fails its
// waiting requests and opens a new session, until Close.
func (c *Client) loop(s *session) {
	defer close(c.done)
	for {
		c.serve(s)
		c.install(nil)
		if c.ctx.Err() != nil {
			s.calls.FailAll(requestreply.ErrClosed)
		} else {
			s.calls.FailAll(requestreply.ErrConnectionLost)
		}
		s.close()
		for {
			if c.ctx.Err() != nil {
				return
			}
			var err error
			s, err = c.open(c.ctx)
			if err == nil {
				break
			}
			if c.ctx.Err() != nil {
				return
			}
			c.log.Warn("amqprr: cannot open a reply queue; retrying", "err", err)
			select {
			case <-time.After(time.Second):
			case <-c.ctx.Done():
				return
			}
		}
		c.install(s)
	}
}

func (c *Client) serve(s *session) {
	deliveries, returns := s.events.deliveries, s.events.returns
	for {
		select {
		case <-s.events.pubClosed:
			return
		case d, ok := <-deliveries:
			if !ok {
				return
			}
			r := requestreply.Reply{Body: d.Body, Result: headerString(d.Headers[requestreply.HeaderResult]),
				Signature: headerString(d.Headers[requestreply.HeaderSignature])}
			if s.calls.Receive(d.CorrelationId, r) == requestreply.Late {
				c.late.Add(1)
				c.log.Debug("amqprr: late or unknown reply dropped", "correlation_id", d.CorrelationId)
			}
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			s.calls.Deliver(r.CorrelationId, requestreply.Reply{Err: fmt.Errorf("%w: no queue %q (%d %s)", requestreply.ErrNoService, r.RoutingKey, r.ReplyCode, r.ReplyText)})
		case <-c.ctx.Done():
			return
		}
	}
}

// session returns the current session, waiting while reconnecting.
func (c *Client) session(ctx context.Context) (*session, error) {
	for {
		c.mu.Lock()
		s, changed := c.sess, c.changed
		c.mu.Unlock()
		if s != nil {
			return s, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-c.ctx.Done():
			return nil, requestreply.ErrClosed
		}
	}
}

// Request implements requestreply.Requester. The request is published to
// the default exchange with routing key service (the server's queue), the
// mandatory flag, message_id = requestID (a random one if empty), a fresh
// correlation_id, and its deadline (ctx's, or now + Timeout) as header
// no_despres and as the AMQP expiration (the milliseconds left). Errors: *requestreply.TimeoutError after the deadline,
// *requestreply.RemoteError for an error reply, requestreply.ErrNoService
// when no queue is named service, requestreply.ErrConnectionLost when the
// connection dropped while waiting, ctx.Err() when ctx is cancelled.
func (c *Client) Request(ctx context.Context, service, requestID string, body []byte) ([]byte, error) {
	if service == "" {
		return nil, errors.New("amqprr: empty service (queue) name")
	}
	// Both travel as AMQP shortstr fields (routing key, message_id). The
	// client library refuses a longer one only after it has begun the frame,
	// and then shuts the whole connection down, failing every other request.
	if len(service) > maxShortstr {
		return nil, fmt.Errorf("amqprr: service (queue) name of %d bytes: AMQP allows at most %d", len(service), maxShortstr)
	}
	if len(requestID) > maxShortstr {
		return nil, fmt.Errorf("amqprr: request id of %d bytes: AMQP message_id allows at most %d", len(requestID), maxShortstr)
	}
	start := time.Now()
	ctx, cancel := requestreply.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	corr := c.ids.Next()
	if requestID == "" {
		requestID = corr
	}
	s, err := c.session(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, requestreply.CtxError(ctx, service, requestID, start)
		}
		return nil, err
	}
	wait, err := s.calls.Add(corr, requestID, s.replyTo)
	if err != nil {
		return nil, err
	}
	mode := amqp091.Transient
	if c.cfg.Persistent {
		mode = amqp091.Persistent
	}
	// The deadline travels twice: no_despres for the server (and for other
	// brokers' servers), expiration so that RabbitMQ drops the request if it
	// is still queued when its requester has given up.
	deadline, _ := ctx.Deadline() // WithTimeout gave it one
	ttl := max(time.Until(deadline).Milliseconds(), 1)
	headers := amqp091.Table{requestreply.HeaderDeadline: requestreply.FormatDeadline(deadline)}
	if len(c.cfg.SigningKey) > 0 {
		headers[requestreply.HeaderSignature] = requestreply.Sign(c.cfg.SigningKey, service, requestID, corr, s.replyTo, headers[requestreply.HeaderDeadline].(string), body)
	}
	err = s.pub.PublishWithContext(ctx, "", service, true, false, amqp091.Publishing{
		Headers:       headers,
		Expiration:    strconv.FormatInt(ttl, 10),
		ContentType:   amqp.ContentTypeJSON,
		DeliveryMode:  mode,
		CorrelationId: corr,
		ReplyTo:       s.replyTo,
		MessageId:     requestID,
		Body:          body,
	})
	if err != nil {
		s.calls.Deliver(corr, requestreply.Reply{}) // unregister
		if ctx.Err() != nil {
			// The deadline passed while publishing: a timeout like any
			// other, which the caller may ask again with the same id.
			return nil, requestreply.CtxError(ctx, service, requestID, start)
		}
		return nil, fmt.Errorf("amqprr: publish request: %w", err)
	}
	return s.calls.Await(ctx, service, requestID, corr, start, wait)
}

// maxShortstr is the longest AMQP shortstr (routing key, message_id).
const maxShortstr = 255

// LateReplies counts replies dropped because their request had timed out
// (or was unknown).
func (c *Client) LateReplies() int64 { return c.late.Load() }

// DroppedReplies counts replies dropped for a missing or wrong signature
// (always 0 without ClientConfig.SigningKey).
func (c *Client) DroppedReplies() int64 { return c.verify.Dropped() }

// Close stops the client: waiting requests fail with ErrClosed and
// the reply queue is deleted with its channel. The Conn stays open.
func (c *Client) Close() error {
	c.cancel()
	<-c.done
	return nil
}
