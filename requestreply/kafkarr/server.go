package kafkarr

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/kafka"
)

// Defaults of ServerConfig.
const (
	TopicDefault   = "pagaments.autoritzacions"
	WorkersDefault = 16
)

// ServerConfig configures a Server.
type ServerConfig struct {
	Brokers []string             // required
	Handler requestreply.Handler // required
	// Topic the requests arrive on, created if absent (Partitions
	// partitions). Default "pagaments.autoritzacions".
	Topic      string
	Partitions int32 // default 6
	// Group is the consumer group of the server instances. Default
	// "<Topic>.servidor".
	Group   string
	Workers int // requests of one poll handled at once; default 16
	// SessionTimeout is the group session timeout: a dead server instance's
	// partitions go to the others this long after its last heartbeat.
	// Default kafka.SessionTimeoutDefault (see kafka.GroupOpts).
	SessionTimeout time.Duration
	Logger         *slog.Logger // default slog.Default()
	// ReplyTopicPrefix: a request whose respondre_a does not start with it
	// is not answered (logged, counted as unanswerable): otherwise any
	// requester could make the server write to any topic, a business topic
	// included. Default ReplyTopicPrefix ("respostes."), the clients' default.
	ReplyTopicPrefix string
}

// ServerStats counts what a Server did.
type ServerStats struct {
	Replied      int64 // replies acknowledged by the broker (error replies included)
	ErrorReplies int64
	Unanswerable int64 // requests without respondre_a or correlacio, or whose reply failed
}

// Server answers requests from a topic in a consumer group. It handles the
// records of each poll concurrently, produces each reply to the request's
// respondre_a topic (acks=all) with the same correlacio, and commits the
// poll's offsets only after every reply was acknowledged: a crash before
// that redelivers the requests, which an Idempotent handler answers from its
// stored responses.
type Server struct {
	cfg  ServerConfig
	prod *kgo.Client
	cons *kgo.Client

	replied, errorReplies, unanswerable atomic.Int64
}

// NewServer creates the request topic if needed and joins the group.
func NewServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	if len(cfg.Brokers) == 0 || cfg.Handler == nil {
		return nil, errors.New("kafkarr: ServerConfig needs Brokers and Handler")
	}
	cfg.Topic = cmp.Or(cfg.Topic, TopicDefault)
	cfg.Group = cmp.Or(cfg.Group, cfg.Topic+".servidor")
	cfg.Partitions = cmp.Or(max(cfg.Partitions, 0), kafka.PartitionsDefault)
	cfg.Workers = cmp.Or(max(cfg.Workers, 0), WorkersDefault)
	cfg.ReplyTopicPrefix = cmp.Or(cfg.ReplyTopicPrefix, ReplyTopicPrefix)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	prod, err := kafka.NewClient(cfg.Brokers)
	if err != nil {
		return nil, err
	}
	if err := kafka.EnsureTopics(ctx, prod, cfg.Partitions, cfg.Topic); err != nil {
		prod.Close()
		return nil, fmt.Errorf("kafkarr: request topic %s: %w", cfg.Topic, err)
	}
	cons, err := kgo.NewClient(append(kafka.GroupOpts(cfg.SessionTimeout), kgo.SeedBrokers(cfg.Brokers...), kgo.ConsumerGroup(cfg.Group), kgo.ConsumeTopics(cfg.Topic),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll(), kgo.FetchMaxWait(time.Second))...)
	if err != nil {
		prod.Close()
		return nil, fmt.Errorf("kafkarr: request consumer: %w", err)
	}
	return &Server{cfg: cfg, prod: prod, cons: cons}, nil
}

// Stats returns the counters so far.
func (s *Server) Stats() ServerStats {
	return ServerStats{Replied: s.replied.Load(), ErrorReplies: s.errorReplies.Load(), Unanswerable: s.unanswerable.Load()}
}

// Run serves until ctx ends, then leaves the group and closes its clients.
// It returns nil.
func (s *Server) Run(ctx context.Context) error {
	defer s.prod.Close()
	defer s.cons.Close()
	defer s.cons.AllowRebalance() // with BlockRebalanceOnPoll, Close waits for it
	for {
		fs := s.cons.PollRecords(ctx, 1000)
		if ctx.Err() != nil {
			return nil
		}
		fs.EachError(func(topic string, p int32, err error) {
			s.cfg.Logger.Warn("kafkarr: request fetch error", "topic", topic, "partition", p, "err", err)
		})
		recs := fs.Records()
		s.handleAll(ctx, recs)
		if len(recs) > 0 {
			if err := s.cons.CommitRecords(ctx, recs...); err != nil && ctx.Err() == nil {
				s.cfg.Logger.Warn("kafkarr: commit failed; the requests may be answered again", "err", err)
			}
		}
		s.cons.AllowRebalance()
	}
}

func (s *Server) handleAll(ctx context.Context, recs []*kgo.Record) {
	sem := make(chan struct{}, s.cfg.Workers)
	var wg sync.WaitGroup
	for _, r := range recs {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			s.handle(ctx, r)
		}()
	}
	wg.Wait()
}

func (s *Server) handle(ctx context.Context, r *kgo.Record) {
	var corr, replyTo, id string
	for _, h := range r.Headers {
		switch h.Key {
		case HeaderCorrelation:
			corr = string(h.Value)
		case HeaderReplyTo:
			replyTo = string(h.Value)
		case HeaderRequestID:
			id = string(h.Value)
		}
	}
	log := s.cfg.Logger
	if corr == "" || replyTo == "" {
		s.unanswerable.Add(1)
		log.Error("kafkarr: request without correlacio or respondre_a skipped", "topic", r.Topic, "partition", r.Partition, "offset", r.Offset)
		return
	}
	if !strings.HasPrefix(replyTo, s.cfg.ReplyTopicPrefix) || replyTo == s.cfg.Topic {
		s.unanswerable.Add(1)
		log.Error("kafkarr: request whose respondre_a is not a reply topic skipped", "respondre_a", replyTo,
			"prefix", s.cfg.ReplyTopicPrefix, "topic", r.Topic, "partition", r.Partition, "offset", r.Offset)
		return
	}
	req := &requestreply.Request{ID: cmp.Or(id, string(r.Key), corr), CorrelationID: corr, Body: r.Value}
	body, isErr := requestreply.Serve(ctx, log, s.cfg.Handler, req)
	result := requestreply.ResultOK
	if isErr {
		result = requestreply.ResultError
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	reply := func(body []byte, result string) error {
		return s.prod.ProduceSync(pctx, &kgo.Record{Topic: replyTo, Key: []byte(corr), Value: body, Headers: []kgo.RecordHeader{
			{Key: HeaderCorrelation, Value: []byte(corr)},
			{Key: requestreply.HeaderResult, Value: []byte(result)},
		}}).FirstErr()
	}
	err := reply(body, result)
	if errors.Is(err, kerr.MessageTooLarge) && !isErr {
		// Kafka refuses a reply this big: answer with a (small) error reply,
		// not with nothing, which the requester would see as a timeout (R5).
		tooLarge := requestreply.BadRequest(fmt.Errorf("reply too large for Kafka (%d bytes): %w", len(body), err))
		body, isErr = requestreply.Serve(ctx, log, func(context.Context, *requestreply.Request) ([]byte, error) { return nil, tooLarge }, req)
		err = reply(body, requestreply.ResultError)
	}
	if err != nil {
		s.unanswerable.Add(1)
		log.Warn("kafkarr: reply not delivered (client gone?)", "respondre_a", replyTo, "id_peticio", req.ID, "err", err)
		return
	}
	s.replied.Add(1)
	if isErr {
		s.errorReplies.Add(1)
	}
}
