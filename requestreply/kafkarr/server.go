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

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/kafka"
)

// Defaults of ServerConfig.
const (
	TopicDefault        = "pagaments.autoritzacions"
	WorkersDefault      = 16
	ReplyTimeoutDefault = 2 * time.Second
)

// ServerConfig configures a Server.
type ServerConfig struct {
	Brokers []string             // required
	Handler requestreply.Handler // required
	// KgoOpts are added to the options of the server's Kafka clients
	// (reply producer and request consumer): kafka.Security's, for a
	// secured cluster. Default none.
	KgoOpts []kgo.Opt
	// Topic the requests arrive on, created if absent (Partitions
	// partitions). Default "pagaments.autoritzacions".
	Topic      string
	Partitions int32 // default 6
	// TopicSettings are the replication factor, min.insync.replicas and
	// retention of the request topic when it is created. Default the zero
	// kafka.TopicSettings (the broker's replication factor, 14 days).
	TopicSettings kafka.TopicSettings
	// Group is the consumer group of the server instances. Default
	// "<Topic>.servidor".
	Group string
	// Workers is how many requests are handled at once. Default 16.
	Workers int
	// MaxInFlight bounds the requests taken from the broker and not finished
	// yet (waiting for a worker or being handled). Default 4 × Workers.
	MaxInFlight int
	// ReplyTimeout bounds the production of one reply; a reply not
	// acknowledged by then (its reply topic is gone, say) is given up and
	// counted as unanswerable. Default ReplyTimeoutDefault (2 s).
	ReplyTimeout time.Duration
	// SessionTimeout is the group session timeout: a dead server instance's
	// partitions go to the others this long after its last heartbeat.
	// Default kafka.SessionTimeoutDefault (see kafka.GroupOpts).
	SessionTimeout time.Duration
	Logger         *slog.Logger // default slog.Default()
	// Metrics, if set, receives requestreply.MetricServerRequests.
	Metrics prometheus.Registerer
	// ReplyTopicPrefix: a request whose respondre_a does not start with it
	// is not answered (logged, counted as unanswerable): otherwise any
	// requester could make the server write to any topic, a business topic
	// included. Default ReplyTopicPrefix ("respostes."), the clients' default.
	ReplyTopicPrefix string
	// MaxBodyBytes bounds a request's body: a longer one gets a
	// non-retryable error reply and the handler does not run. Default
	// requestreply.MaxBodyBytesDefault (64 KiB); negative: no bound.
	MaxBodyBytes int
	// SigningKey, if set, makes the server answer only requests signed with
	// it (requestreply.Verifier over the topic, request id, correlacio,
	// respondre_a, no_despres and body; the others get the error reply
	// requestreply.ErrUnauthenticated and the handler does not run) and
	// sign every reply (requestreply.SignReply), so that its requesters can
	// tell its replies from those of anyone else who reads the topic. At
	// least requestreply.MinKeyBytes, or NewServer fails. Default none: every
	// request is served and replies go unsigned. Never logged.
	SigningKey []byte
}

// ServerStats counts what a Server did.
type ServerStats struct {
	Replied      int64 // replies acknowledged by the broker (error replies included)
	ErrorReplies int64
	Unanswerable int64 // requests without respondre_a or correlacio, or whose reply failed
	Expired      int64 // requests past their no_despres, dropped without running the handler
	// Unauthenticated: requests refused for a missing or wrong signature
	// (with ServerConfig.SigningKey), answered with an error reply.
	Unauthenticated int64
}

// Server answers requests from a topic in a consumer group.
//
// One goroutine polls and hands each request to a pool of Workers; it polls
// again as soon as fewer than MaxInFlight requests are in hand, so a slow
// request holds up one worker and nothing else. A worker drops a request
// whose deadline (header no_despres) has passed without running the handler
// (counted as Expired), otherwise runs the handler and hands the reply to
// the producer without waiting for it: the reply goes to the request's
// respondre_a topic with the same correlacio, bounded by ReplyTimeout, and a
// reply that fails (the client's reply topic is gone) is counted and never
// holds up another. Offsets are committed per partition up to the first
// request not finished (handled or dropped); a request counts as finished
// when its handler returned, before its reply is acknowledged. A crash
// before the commit redelivers requests, which an Idempotent handler answers
// from its stored responses; a reply lost after the commit is recovered the
// same way, by the requester's retry with the same request id.
type Server struct {
	cfg        ServerConfig
	prod       *kgo.Client
	cons       *kgo.Client
	cancelCons context.CancelFunc // ends a leave stuck behind a pending rebalance
	tr         *tracker
	m          *requestreply.ServerMetrics
	verify     *requestreply.Verifier // nil without SigningKey

	replied, errorReplies, unanswerable, expired atomic.Int64
}

// NewServer creates the request topic if needed and joins the group.
func NewServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	if len(cfg.Brokers) == 0 || cfg.Handler == nil {
		return nil, errors.New("kafkarr: ServerConfig needs Brokers and Handler")
	}
	cfg.Topic = cmp.Or(cfg.Topic, TopicDefault)
	cfg.Handler = requestreply.LimitBody(cfg.Handler, cfg.MaxBodyBytes)
	cfg.Group = cmp.Or(cfg.Group, cfg.Topic+".servidor")
	cfg.Partitions = cmp.Or(max(cfg.Partitions, 0), kafka.PartitionsDefault)
	cfg.Workers = cmp.Or(max(cfg.Workers, 0), WorkersDefault)
	cfg.MaxInFlight = cmp.Or(max(cfg.MaxInFlight, 0), 4*cfg.Workers)
	cfg.MaxInFlight = max(cfg.MaxInFlight, cfg.Workers)
	cfg.ReplyTimeout = cmp.Or(max(cfg.ReplyTimeout, 0), ReplyTimeoutDefault)
	cfg.ReplyTopicPrefix = cmp.Or(cfg.ReplyTopicPrefix, ReplyTopicPrefix)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m, err := requestreply.NewServerMetrics(cfg.Metrics, cfg.Topic)
	if err != nil {
		return nil, err
	}
	var v *requestreply.Verifier
	if len(cfg.SigningKey) > 0 {
		if v, err = requestreply.NewVerifier(requestreply.VerifierConfig{Key: cfg.SigningKey, Queue: cfg.Topic, Registerer: cfg.Metrics, Logger: cfg.Logger}); err != nil {
			return nil, fmt.Errorf("kafkarr: %w", err)
		}
		cfg.Handler = v.Wrap(cfg.Handler)
	}
	// Replies are not idempotent writes: a reply is worth nothing once its
	// requester gave up, so the producer may fail it at any moment (a
	// deleted reply topic, the bound) instead of holding it for a retry.
	prod, err := kafka.NewClient(cfg.Brokers, append([]kgo.Opt{kgo.DisableIdempotentWrite(), kgo.RecordDeliveryTimeout(cfg.ReplyTimeout),
		kgo.UnknownTopicRetries(1), kgo.ProduceRequestTimeout(cfg.ReplyTimeout), kgo.MaxBufferedRecords(10 * cfg.MaxInFlight)}, cfg.KgoOpts...)...)
	if err != nil {
		return nil, err
	}
	if err := kafka.EnsureTopicSpecs(ctx, prod, cfg.Logger, cfg.TopicSettings.Spec(cfg.Topic, cfg.Partitions)); err != nil {
		prod.Close()
		return nil, fmt.Errorf("kafkarr: request topic %s: %w", cfg.Topic, err)
	}
	s := &Server{cfg: cfg, prod: prod, tr: newTracker(), m: m, verify: v}
	consCtx, cancelCons := context.WithCancel(context.Background())
	consOpts := append(kafka.GroupOpts(cfg.SessionTimeout), kgo.WithContext(consCtx), kgo.SeedBrokers(cfg.Brokers...), kgo.ConsumerGroup(cfg.Group), kgo.ConsumeTopics(cfg.Topic),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll(), kgo.FetchMaxWait(time.Second),
		kgo.OnPartitionsRevoked(s.revoked), kgo.OnPartitionsLost(s.lost))
	cons, err := kgo.NewClient(append(consOpts, cfg.KgoOpts...)...)
	if err != nil {
		cancelCons()
		prod.Close()
		return nil, fmt.Errorf("kafkarr: request consumer: %w", err)
	}
	s.cons, s.cancelCons = cons, cancelCons
	return s, nil
}

// Stats returns the counters so far.
func (s *Server) Stats() ServerStats {
	st := ServerStats{Replied: s.replied.Load(), ErrorReplies: s.errorReplies.Load(), Unanswerable: s.unanswerable.Load(), Expired: s.expired.Load()}
	if s.verify != nil {
		st.Unauthenticated = s.verify.Refused()
	}
	return st
}

type job struct {
	r *kgo.Record
	p *ptrack
}

// leaveTimeout bounds the group leave when Run stops: kgo's leave waits for a
// JoinGroup in flight, which the broker holds until a member that died
// without leaving expires. Past it the client closes without the leave.
const leaveTimeout = 5 * time.Second

// Run serves until ctx ends, then lets the running handlers finish, commits
// what they finished, leaves the group (at most leaveTimeout) and closes its
// clients. Requests taken but not started are not committed: the group reads
// them again. It returns nil.
func (s *Server) Run(ctx context.Context) error {
	defer s.prod.Close()
	defer func() {
		t := time.AfterFunc(leaveTimeout, s.cancelCons)
		defer t.Stop()
		s.cons.Close()
		s.cancelCons()
	}()
	defer s.cons.AllowRebalance() // with BlockRebalanceOnPoll, Close waits for it

	slots := make(chan struct{}, s.cfg.MaxInFlight)
	work := make(chan job, s.cfg.MaxInFlight)
	kick := make(chan struct{}, 1)
	commitDone := make(chan struct{})
	go func() { defer close(commitDone); s.committer(ctx, kick) }()
	var wg sync.WaitGroup
	for range s.cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range work {
				ran := ctx.Err() == nil && s.tr.begin(j.p)
				done := ran && s.handle(ctx, j.r)
				s.tr.finish(j.p, j.r.Offset, ran, done)
				<-slots
				select {
				case kick <- struct{}{}:
				default:
				}
			}
		}()
	}
	defer func() {
		close(work)
		wg.Wait()
		<-commitDone
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		s.commit(cctx, s.tr.detachAll(cctx))
		_ = s.prod.Flush(cctx) // the last replies, within the bound
	}()
	for {
		// At least one free slot, then as many as are free.
		n := 0
		select {
		case slots <- struct{}{}:
			n = 1
		case <-ctx.Done():
			return nil
		}
	fill:
		for n < s.cfg.MaxInFlight {
			select {
			case slots <- struct{}{}:
				n++
			default:
				break fill
			}
		}
		fs := s.cons.PollRecords(ctx, n)
		if ctx.Err() != nil {
			for range n {
				<-slots
			}
			return nil
		}
		fs.EachError(func(topic string, p int32, err error) {
			s.cfg.Logger.Warn("kafkarr: request fetch error", "topic", topic, "partition", p, "err", err)
		})
		recs := fs.Records()
		parts := s.tr.take(recs) // before a rebalance can revoke them
		s.cons.AllowRebalance()
		for range n - len(recs) {
			<-slots
		}
		for i, r := range recs {
			work <- job{r: r, p: parts[i]} // room: one slot each
		}
	}
}

// committer commits the finished prefixes whenever a worker finishes, one
// commit at a time (completions during a commit go into the next one).
func (s *Server) committer(ctx context.Context, kick <-chan struct{}) {
	for {
		select {
		case <-kick:
			s.commit(ctx, s.tr.ready())
		case <-ctx.Done():
			return
		}
		// At most one commit per commitEvery: completions meanwhile go in
		// the next one (a commit costs the broker more than a reply).
		select {
		case <-time.After(commitEvery):
		case <-ctx.Done():
			return
		}
	}
}

// commitEvery spaces the server's offset commits.
const commitEvery = 50 * time.Millisecond

func (s *Server) commit(ctx context.Context, offs map[string]map[int32]kgo.EpochOffset) {
	if len(offs) == 0 {
		return
	}
	s.cons.CommitOffsetsSync(ctx, offs, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		if err == nil {
			for _, t := range resp.Topics {
				for _, p := range t.Partitions {
					if err == nil {
						err = kerr.ErrorForCode(p.ErrorCode)
					}
				}
			}
		}
		if err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("kafkarr: commit failed; the requests may be answered again", "err", err)
		}
	})
}

// revoked: the partitions go to another member. Their queued requests are
// skipped; the running ones finish and are committed first.
func (s *Server) revoked(ctx context.Context, _ *kgo.Client, m map[string][]int32) {
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	s.commit(ctx, s.tr.detach(wctx, m))
}

// lost: the partitions may be another member's already; nothing is committed.
func (s *Server) lost(ctx context.Context, _ *kgo.Client, m map[string][]int32) {
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	s.tr.detach(wctx, m)
}

func (s *Server) count(res string, n *atomic.Int64) {
	n.Add(1)
	s.m.Count(res)
}

// handle answers r and reports whether it is finished: false when the
// server stopped while the handler ran and it failed (then there is no reply
// and the request is read again).
func (s *Server) handle(ctx context.Context, r *kgo.Record) bool {
	var corr, replyTo, id, deadline, signature string
	for _, h := range r.Headers {
		switch h.Key {
		case contract.HeaderCorrelator:
			corr = string(h.Value)
		case HeaderReplyTo:
			replyTo = string(h.Value)
		case HeaderRequestID:
			id = string(h.Value)
		case requestreply.HeaderDeadline:
			deadline = string(h.Value)
		case requestreply.HeaderSignature:
			signature = string(h.Value)
		}
	}
	log := s.cfg.Logger
	if corr == "" || replyTo == "" {
		s.count(requestreply.ResUnanswerable, &s.unanswerable)
		log.Error("kafkarr: request without correlacio or respondre_a skipped", "topic", r.Topic, "partition", r.Partition, "offset", r.Offset)
		return true
	}
	if !strings.HasPrefix(replyTo, s.cfg.ReplyTopicPrefix) || replyTo == s.cfg.Topic {
		s.count(requestreply.ResUnanswerable, &s.unanswerable)
		log.Error("kafkarr: request whose respondre_a is not a reply topic skipped", "respondre_a", replyTo,
			"prefix", s.cfg.ReplyTopicPrefix, "topic", r.Topic, "partition", r.Partition, "offset", r.Offset)
		return true
	}
	req := &requestreply.Request{ID: cmp.Or(id, string(r.Key), corr), CorrelationID: corr, Body: r.Value, ReplyTo: replyTo, Deadline: deadline, Signature: signature}
	if t, ok := requestreply.ParseDeadline(deadline); requestreply.Expired(t, ok, time.Now()) {
		s.count(requestreply.ResExpired, &s.expired)
		log.Debug("kafkarr: expired request dropped", "id_peticio", req.ID, "no_despres", deadline)
		return true
	}
	body, isErr := requestreply.Serve(ctx, log, s.cfg.Handler, req)
	if isErr && ctx.Err() != nil {
		return false // cut short by the stop: the next server answers it
	}
	s.reply(req, replyTo, body, isErr, true)
	return true
}

// reply hands the reply to the producer and returns at once; the promise
// counts the outcome. A reply Kafka refuses as too large is replaced by a
// small error reply (not by nothing, which the requester would see as a
// timeout).
func (s *Server) reply(req *requestreply.Request, replyTo string, body []byte, isErr, retryLarge bool) {
	result := requestreply.ResultOK
	if isErr {
		result = requestreply.ResultError
	}
	rec := &kgo.Record{Topic: replyTo, Key: []byte(req.CorrelationID), Value: body, Headers: []kgo.RecordHeader{
		{Key: contract.HeaderCorrelator, Value: []byte(req.CorrelationID)},
		{Key: requestreply.HeaderResult, Value: []byte(result)},
	}}
	if len(s.cfg.SigningKey) > 0 {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: requestreply.HeaderSignature,
			Value: []byte(requestreply.SignReply(s.cfg.SigningKey, req.ID, req.CorrelationID, replyTo, result, body))})
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.ReplyTimeout)
	s.prod.TryProduce(ctx, rec, func(_ *kgo.Record, err error) {
		cancel()
		switch {
		case err == nil:
			s.replied.Add(1)
			if isErr {
				s.count(requestreply.ResErrorReply, &s.errorReplies)
			} else {
				s.m.Count(requestreply.ResReplied)
			}
		case errors.Is(err, kerr.MessageTooLarge) && retryLarge:
			tooLarge := requestreply.BadRequest(fmt.Errorf("reply too large for Kafka (%d bytes): %w", len(body), err))
			eb, _ := requestreply.Serve(context.Background(), s.cfg.Logger,
				func(context.Context, *requestreply.Request) ([]byte, error) { return nil, tooLarge }, req)
			go s.reply(req, replyTo, eb, true, false) // promises must not produce
		default:
			s.count(requestreply.ResUnanswerable, &s.unanswerable)
			s.cfg.Logger.Debug("kafkarr: reply not delivered (client gone?)", "respondre_a", replyTo, "id_peticio", req.ID, "err", err)
		}
	})
}
