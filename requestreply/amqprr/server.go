package amqprr

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"sync/atomic"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/amqp"
)

// Defaults of ServerConfig.
const (
	QueueDefault    = "pagaments.autoritzacions"
	PrefetchDefault = 64
	WorkersDefault  = 16
)

// ServerConfig configures a Server.
type ServerConfig struct {
	Conn    *amqp.Conn           // required
	Handler requestreply.Handler // required
	// Queue the requests arrive on. Default "pagaments.autoritzacions". It
	// is declared durable with CONTRACT.md's dead-letter topology
	// (km0.dlx, <queue>.dlq) for requests that cannot be answered.
	Queue    string
	Prefetch int // default 64
	Workers  int // requests handled at once; default 16
	DLX      string
	Logger   *slog.Logger // default slog.Default()
}

// ServerStats counts what a Server did.
type ServerStats struct {
	Replied      int64 // replies confirmed by the broker (error replies included)
	ErrorReplies int64 // of which error replies
	Orphaned     int64 // replies returned unroutable: the client's queue was gone
	DeadLettered int64 // requests without reply_to or correlation_id, or unanswerable
}

// Server answers requests from a queue. For each request it runs the
// handler, publishes the reply to reply_to with the same correlation_id
// (mandatory, confirmed, transient), and acks the request only after the
// reply is confirmed. A reply returned unroutable (the client and its
// exclusive queue are gone) is counted as orphaned and the request acked. If
// the connection drops before the confirm, the request stays unacked and the
// broker redelivers it: the handler runs again, which an Idempotent handler
// answers from its stored response. If the broker refuses the reply three
// times on a live connection, the request is dead-lettered rather than
// requeued (never a requeue loop). A request with no reply_to or
// correlation_id cannot be answered and is dead-lettered (nack without
// requeue) to <queue>.dlq.
type Server struct {
	cfg ServerConfig
	pub *amqp.Publisher

	replied, errorReplies, orphaned, dead atomic.Int64
}

// NewServer declares the request queue and returns the Server; Run serves.
func NewServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	if cfg.Conn == nil || cfg.Handler == nil {
		return nil, errors.New("amqprr: ServerConfig needs Conn and Handler")
	}
	cfg.Queue = cmp.Or(cfg.Queue, QueueDefault)
	cfg.Prefetch = cmp.Or(max(cfg.Prefetch, 0), PrefetchDefault)
	cfg.Workers = cmp.Or(max(cfg.Workers, 0), WorkersDefault)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := cfg.Conn.Declare(ctx, amqp.WorkQueueTopology(cfg.DLX, cfg.Queue, cfg.Queue, false)); err != nil {
		return nil, err
	}
	pub, err := amqp.NewPublisher(ctx, cfg.Conn, amqp.PublisherConfig{Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	return &Server{cfg: cfg, pub: pub}, nil
}

// Queues returns the queues the server declared (the request queue and its DLQ).
func (s *Server) Queues() []string { return []string{s.cfg.Queue, amqp.DLQName(s.cfg.Queue)} }

// Stats returns the counters so far.
func (s *Server) Stats() ServerStats {
	return ServerStats{Replied: s.replied.Load(), ErrorReplies: s.errorReplies.Load(), Orphaned: s.orphaned.Load(), DeadLettered: s.dead.Load()}
}

// Run serves until ctx ends (then it finishes the requests in hand and
// returns nil). It returns an error only if the Conn is closed.
func (s *Server) Run(ctx context.Context) error {
	defer s.pub.Close() //nolint:errcheck // best effort
	return s.cfg.Conn.Subscribe(ctx, amqp.SubscribeConfig{Queue: s.cfg.Queue, Prefetch: s.cfg.Prefetch,
		Workers: s.cfg.Workers, Logger: s.cfg.Logger}, s.handle)
}

func (s *Server) handle(ctx context.Context, d *amqp091.Delivery) {
	log := s.cfg.Logger
	if d.ReplyTo == "" || d.CorrelationId == "" {
		log.Error("amqprr: request without reply_to or correlation_id dead-lettered", "queue", s.cfg.Queue,
			"message_id", d.MessageId, "reply_to", d.ReplyTo, "correlation_id", d.CorrelationId)
		s.dead.Add(1)
		_ = d.Nack(false, false)
		return
	}
	req := &requestreply.Request{ID: cmp.Or(d.MessageId, d.CorrelationId), CorrelationID: d.CorrelationId, Body: d.Body}
	body, isErr := requestreply.Serve(ctx, log, s.cfg.Handler, req)
	result := requestreply.ResultOK
	if isErr {
		result = requestreply.ResultError
	}
	reply := amqp091.Publishing{
		Headers:       amqp091.Table{requestreply.HeaderResult: result},
		ContentType:   amqp.ContentTypeJSON,
		DeliveryMode:  amqp091.Transient,
		CorrelationId: d.CorrelationId,
		MessageId:     req.ID,
		Body:          body,
	}
	err := s.pub.PublishRawRetry(ctx, "", d.ReplyTo, reply)
	switch {
	case err == nil:
		s.replied.Add(1)
		if isErr {
			s.errorReplies.Add(1)
		}
		_ = d.Ack(false)
		return
	case errors.Is(err, amqp.ErrUnroutable):
		// The client is gone (its exclusive queue went with it). The effect,
		// if any, is done; nobody can take the reply. Ack.
		s.orphaned.Add(1)
		log.Warn("amqprr: reply returned: the client's queue is gone", "reply_to", d.ReplyTo, "id_peticio", req.ID)
		_ = d.Ack(false)
		return
	case ctx.Err() != nil:
		return // shutting down: unacked, redelivered
	}
	// The broker accepts no reply: do not loop on the request. If the channel
	// is gone this nack fails and the broker redelivers the request; if not,
	// the request goes to the DLQ for an operator.
	log.Error("amqprr: cannot publish the reply; request dead-lettered", "queue", s.cfg.Queue, "id_peticio", req.ID, "err", err)
	s.dead.Add(1)
	_ = d.Nack(false, false)
}
