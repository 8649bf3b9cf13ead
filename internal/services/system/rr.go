package system

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/transport/amqp"
)

// RequestReplyAvailable says whether this build carries request/reply
// (package requestreply). It does.
const RequestReplyAvailable = true

// rrStack is the system's request/reply transport: RabbitMQ when
// Config.AMQPURL is set (queues pagaments.autoritzacions and
// inventari.reserves), else Kafka (topics of the same names, a reply topic per
// requester).
//
// With Config.SigningKey (default $KM0_RR_HMAC_KEY) its requesters sign
// every request and drop replies not signed with the key, and its servers
// refuse unsigned or badly signed requests and sign their replies. Without
// one (Config.AcceptUnsignedRequests) requests and replies go unsigned, and
// a warning says so at start. Their counters (requestreply.MetricServerRequests,
// MetricUnauthenticated, MetricRepliesDropped) go to Prometheus' default
// registry, which the console's /metrics serves.
type rrStack struct {
	s       *System
	conn    *amqp.Conn // nil over Kafka
	key     []byte     // the shared signing key; nil: unsigned
	warned  bool       // the warning about serving without a key is out
	closers []func() error
}

func newRR(ctx context.Context, s *System) (*rrStack, error) {
	r := &rrStack{s: s, key: s.cfg.SigningKey}
	if r.unsigned() {
		r.warned = true
		s.log.Warn("system: request/reply without a signing key (accept unsigned requests): pagaments answers anyone who can publish to " +
			pagaments.AuthQueue + " and comandes takes any reply; set " + requestreply.SigningKeyEnv + " (the same key for comandes and pagaments) to refuse them")
	}
	if s.cfg.AMQPURL != "" {
		// Many requests are answered and acked at once: their frames go
		// out together (amqp.Config.CoalesceWrites).
		conn, err := amqp.Dial(ctx, amqp.Config{URL: s.cfg.AMQPURL, Name: "km0-system", Logger: s.log, CoalesceWrites: true, TLS: s.cfg.AMQPTLS})
		if err != nil {
			return nil, fmt.Errorf("request/reply over RabbitMQ: %w", err)
		}
		r.conn = conn
		r.closers = append(r.closers, conn.Close)
	}
	return r, nil
}

// RequestReplyTransport names the request/reply transport in use.
func (s *System) RequestReplyTransport() string {
	if s.rr != nil && s.rr.conn != nil {
		return "RabbitMQ"
	}
	return "Kafka"
}

// Workers of the request/reply servers: pagaments' authorisations share
// their commits (pagaments.Service.Authorize batches concurrent calls), so
// they need as many requests in hand as callers to batch; others use few.
const (
	rrWorkersAuthorize = 64
	rrWorkersDefault   = 4
)

// serve answers requests on queue (a topic over Kafka) with h, handling
// workers requests at once, under the supervisor.
func (r *rrStack) serve(ctx context.Context, queue string, workers int, h func(ctx context.Context, body []byte) ([]byte, error)) error {
	var handler requestreply.Handler = func(ctx context.Context, req *requestreply.Request) ([]byte, error) { return h(ctx, req.Body) }
	log := r.s.log.With("rr", queue)
	if r.key == nil && !r.warned {
		r.warned = true
		r.s.log.Warn("system: request/reply servers accept unsigned requests: anyone who can publish to "+queue+" is trusted; set "+
			requestreply.SigningKeyEnv+" (the same key in every process) to refuse them", "cua", queue)
	}
	var run func(context.Context) error
	if r.conn != nil {
		srv, err := amqprr.NewServer(ctx, amqprr.ServerConfig{Conn: r.conn, Handler: handler, Queue: queue, Workers: workers, Prefetch: 2 * workers, Logger: log, SigningKey: r.key, Metrics: prometheus.DefaultRegisterer})
		if err != nil {
			return err
		}
		run = srv.Run
	} else {
		srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: r.s.cfg.Brokers, Handler: handler, Topic: queue, Workers: workers, Logger: log, SigningKey: r.key, Metrics: prometheus.DefaultRegisterer, KgoOpts: r.s.cfg.KafkaOpts,
			TopicSettings: r.s.cfg.TopicSettings})
		if err != nil {
			return err
		}
		run = srv.Run
	}
	r.s.sup.run("rr "+queue, run)
	return nil
}

// requester returns a new requester on the transport, closed with the system.
func (r *rrStack) requester(ctx context.Context) (requestreply.Requester, error) {
	if r.conn != nil {
		c, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: r.conn, SigningKey: r.key, Metrics: prometheus.DefaultRegisterer, Logger: r.s.log})
		if err != nil {
			return nil, err
		}
		r.closers = append(r.closers, c.Close)
		return c, nil
	}
	c, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: r.s.cfg.Brokers, SigningKey: r.key, Metrics: prometheus.DefaultRegisterer, Logger: r.s.log, KgoOpts: r.s.cfg.KafkaOpts,
		TopicSettings: r.s.cfg.TopicSettings})
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, c.Close)
	return c, nil
}

// authorizer asks pagaments.autoritzacions, with request id
// "autoritzacio-<order id>" so that a retried order asks the same question.
func (r *rrStack) authorizer(ctx context.Context) (comandes.Authorizer, error) {
	req, err := r.requester(ctx)
	if err != nil {
		return nil, err
	}
	return authorizerFunc(func(ctx context.Context, orderID string, totalCents int64) error {
		body, _ := json.Marshal(pagaments.AuthRequest{OrderID: orderID, TotalCents: totalCents})
		out, err := req.Request(ctx, pagaments.AuthQueue, "autoritzacio-"+orderID, body)
		if errors.Is(err, requestreply.ErrConflict) {
			return fmt.Errorf("%w: %w", comandes.ErrAuthConflict, err)
		}
		if err != nil {
			return err
		}
		var resp pagaments.AuthResponse
		if err := json.Unmarshal(out, &resp); err != nil {
			return fmt.Errorf("pagaments: unreadable authorisation: %w", err)
		}
		if !resp.Approved {
			return fmt.Errorf("%s: %w", resp.Reason, comandes.ErrRefused)
		}
		return nil
	}), nil
}

// unsigned reports whether the process serves or asks for authorisations
// without a signing key.
func (r *rrStack) unsigned() bool { return len(r.key) == 0 && r.s.cfg.usesRR() }

func (r *rrStack) close() {
	for i := len(r.closers) - 1; i >= 0; i-- {
		_ = r.closers[i]()
	}
}

type authorizerFunc func(ctx context.Context, orderID string, totalCents int64) error

func (f authorizerFunc) Authorize(ctx context.Context, orderID string, totalCents int64) error {
	return f(ctx, orderID, totalCents)
}
