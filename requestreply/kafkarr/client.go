// Package kafkarr is request/reply over Kafka, with the API of package
// requestreply, so that the embedded mode (kfake, no RabbitMQ) can use it.
//
// A request is a record on the service's topic (e.g.
// pagaments.autoritzacions), keyed by request id, with headers correlacio
// (this attempt's correlation id), respondre_a (the client's reply topic),
// id_peticio and no_despres (the requester's deadline, unix seconds). Each client owns a reply topic (one partition, created at
// start and deleted at Close) that only it reads; the server produces the
// reply there with the same correlacio and the header resultat.
package kafkarr

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/kafka"
)

// Record headers of the wire format, besides contract.HeaderCorrelator
// (correlacio), the correlation id.
const (
	HeaderReplyTo   = "respondre_a"
	HeaderRequestID = "id_peticio"
)

// ReplyTopicPrefix starts the name of each client's reply topic.
const ReplyTopicPrefix = "respostes."

// ClientConfig configures a Client.
type ClientConfig struct {
	Brokers []string // required
	// KgoOpts are added to the options of the client's Kafka clients
	// (producer and reply consumer): kafka.Security's, for a secured
	// cluster. Default none.
	KgoOpts []kgo.Opt
	// ReplyTopic is this client's reply topic. Default "respostes.<random>".
	// It is created (one partition) by NewClient and deleted by Close.
	ReplyTopic string
	// Timeout applies to a request whose context has no deadline.
	// Default requestreply.TimeoutDefault (5 s).
	Timeout time.Duration
	// SigningKey, if set, signs every request (header
	// requestreply.HeaderSignature; see requestreply.Sign) for servers that
	// verify, and makes the client drop every reply not signed with it
	// (requestreply.SignReply): anyone who reads the request topic sees
	// respondre_a and correlacio, so without it anyone may answer first.
	// A request whose reply is dropped waits on, for the server's reply or
	// its deadline. At least requestreply.MinKeyBytes, or NewClient fails.
	// Default none: requests go unsigned and any reply is taken. Never
	// logged.
	SigningKey []byte
	// Metrics, if set, receives requestreply.MetricRepliesDropped.
	Metrics prometheus.Registerer
	Logger  *slog.Logger // default slog.Default()
	// TopicSettings are the replication factor and min.insync.replicas of
	// the reply topic (one partition). Default the zero kafka.TopicSettings
	// (the broker's replication factor).
	TopicSettings kafka.TopicSettings
}

// Client is a requestreply.Requester over Kafka. Many goroutines may call
// Request at once; replies are matched by correlacio, and a reply that
// arrives after its request timed out is dropped and counted (LateReplies).
type Client struct {
	cfg    ClientConfig
	prod   *kgo.Client
	cons   *kgo.Client
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	calls  *requestreply.Calls
	ids    *requestreply.IDs
	late   atomic.Int64
	verify *requestreply.ReplyVerifier
}

var _ requestreply.Requester = (*Client)(nil)

// NewClient creates the reply topic and starts reading it.
func NewClient(ctx context.Context, cfg ClientConfig) (*Client, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("kafkarr: ClientConfig.Brokers is required")
	}
	if cfg.ReplyTopic == "" {
		cfg.ReplyTopic = ReplyTopicPrefix + requestreply.NewIDs().Prefix()
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = requestreply.TimeoutDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	verify, err := requestreply.NewReplyVerifier(cfg.SigningKey, cfg.Metrics, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("kafkarr: %w", err)
	}
	prod, err := kafka.NewClient(cfg.Brokers, cfg.KgoOpts...)
	if err != nil {
		return nil, err
	}
	if err := kafka.EnsureTopicSpecs(ctx, prod, cfg.Logger, cfg.TopicSettings.Spec(cfg.ReplyTopic, 1)); err != nil {
		prod.Close()
		return nil, fmt.Errorf("kafkarr: create reply topic %s: %w", cfg.ReplyTopic, err)
	}
	// The topic is new, so reading from its start loses no reply, however late
	// the first fetch is.
	cons, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(cfg.Brokers...), kgo.ConsumeTopics(cfg.ReplyTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(time.Second)}, cfg.KgoOpts...)...)
	if err != nil {
		prod.Close()
		return nil, fmt.Errorf("kafkarr: reply consumer: %w", err)
	}
	c := &Client{cfg: cfg, prod: prod, cons: cons, done: make(chan struct{}), calls: requestreply.NewCalls(verify), ids: requestreply.NewIDs(), verify: verify}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	go c.loop()
	return c, nil
}

func (c *Client) loop() {
	defer close(c.done)
	for {
		fs := c.cons.PollFetches(c.ctx)
		if c.ctx.Err() != nil {
			return
		}
		fs.EachError(func(topic string, p int32, err error) {
			c.cfg.Logger.Warn("kafkarr: reply fetch error", "topic", topic, "partition", p, "err", err)
		})
		fs.EachRecord(func(r *kgo.Record) {
			var corr string
			rep := requestreply.Reply{Body: r.Value}
			for _, h := range r.Headers {
				switch h.Key {
				case contract.HeaderCorrelator:
					corr = string(h.Value)
				case requestreply.HeaderResult:
					rep.Result = string(h.Value)
				case requestreply.HeaderSignature:
					rep.Signature = string(h.Value)
				}
			}
			if c.calls.Receive(corr, rep) == requestreply.Late {
				c.late.Add(1)
				c.cfg.Logger.Debug("kafkarr: late or unknown reply dropped", "correlacio", corr)
			}
		})
	}
}

// Request implements requestreply.Requester: it produces the request to the
// topic named service (acks=all), with its deadline (ctx's, or now + Timeout)
// in header no_despres, and waits for the reply on the client's
// reply topic. Errors: *requestreply.TimeoutError after the deadline,
// *requestreply.RemoteError for an error reply, the producer's error if the
// request could not be written, ctx.Err() when ctx is cancelled,
// requestreply.ErrClosed after Close.
func (c *Client) Request(ctx context.Context, service, requestID string, body []byte) ([]byte, error) {
	if service == "" {
		return nil, errors.New("kafkarr: empty service (topic) name")
	}
	if c.ctx.Err() != nil {
		return nil, requestreply.ErrClosed
	}
	start := time.Now()
	ctx, cancel := requestreply.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	corr := c.ids.Next()
	if requestID == "" {
		requestID = corr
	}
	wait, err := c.calls.Add(corr, requestID, c.cfg.ReplyTopic)
	if err != nil {
		return nil, err
	}
	deadline, _ := ctx.Deadline() // WithTimeout gave it one
	noLater := requestreply.FormatDeadline(deadline)
	rec := &kgo.Record{Topic: service, Key: []byte(requestID), Value: body, Headers: []kgo.RecordHeader{
		{Key: contract.HeaderCorrelator, Value: []byte(corr)},
		{Key: HeaderReplyTo, Value: []byte(c.cfg.ReplyTopic)},
		{Key: HeaderRequestID, Value: []byte(requestID)},
		{Key: requestreply.HeaderDeadline, Value: []byte(noLater)},
	}}
	if len(c.cfg.SigningKey) > 0 {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: requestreply.HeaderSignature,
			Value: []byte(requestreply.Sign(c.cfg.SigningKey, service, requestID, corr, c.cfg.ReplyTopic, noLater, body))})
	}
	c.prod.Produce(ctx, rec, func(_ *kgo.Record, err error) {
		if err != nil && ctx.Err() == nil {
			if errors.Is(err, kerr.UnknownTopicOrPartition) { // no request topic: nobody serves it (as a returned AMQP request)
				err = fmt.Errorf("%w: no topic %q: %w", requestreply.ErrNoService, service, err)
			}
			c.calls.Deliver(corr, requestreply.Reply{Err: fmt.Errorf("kafkarr: produce request to %s: %w", service, err)})
		}
	})
	return c.calls.Await(ctx, service, requestID, corr, start, wait)
}

// LateReplies counts replies dropped because their request had timed out.
func (c *Client) LateReplies() int64 { return c.late.Load() }

// DroppedReplies counts replies dropped for a missing or wrong signature
// (always 0 without ClientConfig.SigningKey).
func (c *Client) DroppedReplies() int64 { return c.verify.Dropped() }

// ReplyTopic returns the client's reply topic.
func (c *Client) ReplyTopic() string { return c.cfg.ReplyTopic }

// Close stops reading replies, fails the waiting requests with
// requestreply.ErrClosed, deletes the reply topic and closes the Kafka
// clients. It returns the topic deletion's error, if any.
func (c *Client) Close() error {
	c.cancel()
	<-c.done
	c.calls.FailAll(requestreply.ErrClosed)
	c.cons.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := kadm.NewClient(c.prod).DeleteTopics(ctx, c.cfg.ReplyTopic)
	if err == nil {
		err = resp.Error() // the topic's own error: not deleted either
	}
	c.prod.Close()
	if err != nil {
		return fmt.Errorf("kafkarr: delete reply topic %s: %w", c.cfg.ReplyTopic, err)
	}
	return nil
}
