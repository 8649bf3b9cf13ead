package amqprr

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
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
	// Metrics, if set, receives requestreply.MetricServerRequests.
	Metrics prometheus.Registerer
	// MaxBodyBytes bounds a request's body: a longer one gets a
	// non-retryable error reply and the handler does not run. Default
	// requestreply.MaxBodyBytesDefault (64 KiB); negative: no bound.
	MaxBodyBytes int
	// SigningKey, if set, makes the server answer only requests signed with
	// it (requestreply.Verifier over the queue, request id, correlation id,
	// reply_to, no_despres and body; the others get the error reply
	// requestreply.ErrUnauthenticated and the handler does not run) and
	// sign every reply (requestreply.SignReply), so that its requesters can
	// tell its replies from anyone else's. At least
	// requestreply.MinKeyBytes, or NewServer fails. Default none: every
	// request is served and replies go unsigned. Never logged.
	SigningKey []byte
}

// ServerStats counts what a Server did.
type ServerStats struct {
	Replied      int64 // replies written to the broker (error replies included)
	ErrorReplies int64 // of which error replies
	Orphaned     int64 // of Replied, returned unroutable: the client's queue was gone
	DeadLettered int64 // requests without reply_to or correlation_id, or unanswerable
	Expired      int64 // requests past their no_despres, dropped without running the handler
	// Unauthenticated: requests refused for a missing or wrong signature
	// (with ServerConfig.SigningKey), answered with an error reply.
	Unauthenticated int64
}

// Server answers requests from a queue.
//
// For each request it drops it unhandled (ack, counted as Expired) if its
// deadline (header no_despres) has passed; RabbitMQ itself drops the
// requests that expire while queued (AMQP expiration, which the Client
// sets), dead-lettering them to <queue>.dlq like every message of the queue
// that dies there. Otherwise it runs the handler, publishes the reply to
// reply_to with the same correlation_id (transient, mandatory except to a
// direct reply-to consumer: see DirectReplyTo; not confirmed) and acks the
// request as soon as the reply is written: the worker is free for the next
// request. A reply is counted as Replied when written; one that the broker
// returns unroutable (the client and its exclusive queue are gone) is
// counted again, as Orphaned, when the return arrives. Publisher confirms
// would tell nothing a requester needs (see below) and cost the broker and
// this process work per reply.
//
// What is durable when the request is acked is what the handler made
// durable before returning: an Idempotent handler has committed the effect
// and the stored response. A reply lost after that (the server or the
// connection dies before the broker routed it) is recovered by the
// requester, which times out and asks again with the same request id, and
// gets the stored response. If the connection drops before the ack, the
// request is redelivered and answered again the same way. If the reply
// cannot be published twice in a row on a live connection, the request is
// dead-lettered rather than requeued (never a requeue loop). A request with
// no reply_to or correlation_id cannot be answered and is dead-lettered (nack
// without requeue) to <queue>.dlq.
type Server struct {
	cfg    ServerConfig
	rep    *replier
	m      *requestreply.ServerMetrics
	verify *requestreply.Verifier // nil without SigningKey

	replied, errorReplies, orphaned, dead, expired atomic.Int64

	afterHandle, afterAck func() // test hooks (crash points), nil in use
}

// NewServer declares the request queue and returns the Server; Run serves.
func NewServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	if cfg.Conn == nil || cfg.Handler == nil {
		return nil, errors.New("amqprr: ServerConfig needs Conn and Handler")
	}
	cfg.Queue = cmp.Or(cfg.Queue, QueueDefault)
	cfg.Handler = requestreply.LimitBody(cfg.Handler, cfg.MaxBodyBytes)
	cfg.Prefetch = cmp.Or(max(cfg.Prefetch, 0), PrefetchDefault)
	cfg.Workers = cmp.Or(max(cfg.Workers, 0), WorkersDefault)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m, err := requestreply.NewServerMetrics(cfg.Metrics, cfg.Queue)
	if err != nil {
		return nil, err
	}
	var v *requestreply.Verifier
	if len(cfg.SigningKey) > 0 {
		if v, err = requestreply.NewVerifier(requestreply.VerifierConfig{Key: cfg.SigningKey, Queue: cfg.Queue, Registerer: cfg.Metrics, Logger: cfg.Logger}); err != nil {
			return nil, fmt.Errorf("amqprr: %w", err)
		}
		cfg.Handler = v.Wrap(cfg.Handler)
	}
	if err := cfg.Conn.Declare(ctx, amqp.WorkQueueTopology(cfg.DLX, cfg.Queue, cfg.Queue, false)); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, m: m, verify: v}
	s.rep = newReplier(cfg.Conn, s.replyReturned)
	return s, nil
}

// Queues returns the queues the server declared (the request queue and its DLQ).
func (s *Server) Queues() []string { return []string{s.cfg.Queue, contract.DLQName(s.cfg.Queue)} }

// Stats returns the counters so far.
func (s *Server) Stats() ServerStats {
	return ServerStats{Replied: s.replied.Load(), ErrorReplies: s.errorReplies.Load(), Orphaned: s.orphaned.Load(),
		DeadLettered: s.dead.Load(), Expired: s.expired.Load(), Unauthenticated: s.refused()}
}

func (s *Server) refused() int64 {
	if s.verify == nil {
		return 0
	}
	return s.verify.Refused()
}

// signedReplyTo is the reply address as signed: the requester knows only
// DirectReplyTo, which the broker completes with a token for the server.
func signedReplyTo(replyTo string) string {
	if isDirectReplyTo(replyTo) {
		return DirectReplyTo
	}
	return replyTo
}

// Run serves until ctx ends (then it finishes the requests in hand and
// returns nil). It returns an error only if the Conn is closed.
func (s *Server) Run(ctx context.Context) error {
	defer s.rep.close()
	return s.cfg.Conn.Subscribe(ctx, amqp.SubscribeConfig{Queue: s.cfg.Queue, Prefetch: s.cfg.Prefetch,
		Workers: s.cfg.Workers, Logger: s.cfg.Logger}, s.handle)
}

func (s *Server) count(res string, n *atomic.Int64) {
	n.Add(1)
	s.m.Count(res)
}

// replyReturned counts a reply the broker returned unroutable: the client
// is gone (its exclusive queue went with it). The effect, if any, is done;
// nobody can take the reply.
func (s *Server) replyReturned(ret amqp091.Return) {
	s.count(requestreply.ResOrphaned, &s.orphaned)
	s.cfg.Logger.Info("amqprr: reply returned: the client's queue is gone", "reply_to", ret.RoutingKey, "id_peticio", ret.MessageId)
}

// deadlineOf returns a delivery's no_despres (a string of unix seconds; a
// number is accepted too) and whether it has a valid one.
func deadlineOf(d *amqp091.Delivery) (time.Time, bool) {
	switch v := d.Headers[requestreply.HeaderDeadline].(type) {
	case string:
		return requestreply.ParseDeadline(v)
	case []byte:
		return requestreply.ParseDeadline(string(v))
	case float64, float32, int64, int32, int16, int8, int:
		return requestreply.ParseDeadline(fmt.Sprint(v))
	}
	return time.Time{}, false
}

// headerString returns a string header's value ("" for any other type).
func headerString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	}
	return ""
}

func (s *Server) handle(ctx context.Context, d *amqp091.Delivery) {
	log := s.cfg.Logger
	if d.ReplyTo == "" || d.CorrelationId == "" {
		log.Error("amqprr: request without reply_to or correlation_id dead-lettered", "queue", s.cfg.Queue,
			"message_id", d.MessageId, "reply_to", d.ReplyTo, "correlation_id", d.CorrelationId)
		s.count(requestreply.ResUnanswerable, &s.dead)
		_ = d.Nack(false, false)
		return
	}
	req := &requestreply.Request{ID: cmp.Or(d.MessageId, d.CorrelationId), CorrelationID: d.CorrelationId, Body: d.Body, ReplyTo: signedReplyTo(d.ReplyTo),
		Deadline: headerString(d.Headers[requestreply.HeaderDeadline]), Signature: headerString(d.Headers[requestreply.HeaderSignature])}
	if t, ok := deadlineOf(d); requestreply.Expired(t, ok, time.Now()) {
		s.count(requestreply.ResExpired, &s.expired)
		log.Debug("amqprr: expired request dropped", "id_peticio", req.ID, "no_despres", t)
		_ = d.Ack(false)
		return
	}
	body, isErr := requestreply.Serve(ctx, log, s.cfg.Handler, req)
	if isErr && ctx.Err() != nil {
		return // cut short by the stop: unacked, redelivered to the next server
	}
	result := requestreply.ResultOK
	if isErr {
		result = requestreply.ResultError
	}
	headers := amqp091.Table{requestreply.HeaderResult: result}
	if len(s.cfg.SigningKey) > 0 {
		headers[requestreply.HeaderSignature] = requestreply.SignReply(s.cfg.SigningKey, req.ID, req.CorrelationID, req.ReplyTo, result, body)
	}
	reply := amqp091.Publishing{
		Headers:       headers,
		ContentType:   amqp.ContentTypeJSON,
		DeliveryMode:  amqp091.Transient,
		CorrelationId: d.CorrelationId,
		MessageId:     req.ID,
		Body:          body,
	}
	if s.afterHandle != nil {
		s.afterHandle()
	}
	var err error
	for try := range 2 { // a dead channel is replaced once
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = s.rep.publish(pctx, d.ReplyTo, reply)
		cancel()
		if err == nil || ctx.Err() != nil || try == 1 {
			break
		}
	}
	switch {
	case err == nil:
		s.replied.Add(1)
		if isErr {
			s.count(requestreply.ResErrorReply, &s.errorReplies)
		} else {
			s.m.Count(requestreply.ResReplied)
		}
		_ = d.Ack(false)
		if s.afterAck != nil {
			s.afterAck()
		}
	case ctx.Err() != nil:
		// Shutting down: unacked, redelivered.
	default:
		// The broker accepts no reply: do not loop on the request. If the
		// channel is gone this nack fails and the broker redelivers the
		// request; if not, the request goes to the DLQ for an operator.
		log.Error("amqprr: cannot publish the reply; request dead-lettered", "queue", s.cfg.Queue, "id_peticio", req.ID, "err", err)
		s.count(requestreply.ResUnanswerable, &s.dead)
		_ = d.Nack(false, false)
	}
}
