package kafka

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/transport"
)

// Defaults of SourceConfig.
const (
	// CommitIntervalDefault is the least time between two offset commits of
	// the background committer. A commit is issued as soon as work finishes
	// and the previous commit is at least this old.
	CommitIntervalDefault = 20 * time.Millisecond
	// MaxHeldDefault is how many retry copies one retry partition may hold in
	// memory while waiting for their no_abans before the partition is paused.
	MaxHeldDefault = 10_000
)

// SourceConfig configures a Kafka Source. Fields without a default are
// required.
type SourceConfig struct {
	// Brokers are the Kafka bootstrap brokers. Required.
	Brokers []string
	// Group is the consumer group. Required.
	Group string
	// Topics are the domain topics consumed (not their .retry/.dlq topics,
	// which the source derives). Required.
	Topics []string
	// CommitInterval is the least time between two background offset
	// commits. Default CommitIntervalDefault.
	CommitInterval time.Duration
	// MaxHeld bounds the retry copies held per retry partition. Default
	// MaxHeldDefault.
	MaxHeld int
	// TopicPartitions is the partition count used when the source creates a
	// missing .retry or .dlq topic. Default PartitionsDefault (6).
	TopicPartitions int32
	// TopicSettings are the replication factor, min.insync.replicas and
	// retention of a .retry or .dlq topic the source creates. Default the
	// zero TopicSettings (the broker's replication factor, 14 days).
	TopicSettings TopicSettings
	// NoCreateTopics stops Run from creating missing .retry and .dlq topics.
	NoCreateTopics bool
	// SessionTimeout is the group session timeout: a member that dies
	// without leaving (SIGKILL) loses its partitions to the others this long
	// after its last heartbeat. It must lie within the brokers'
	// group.min.session.timeout.ms and group.max.session.timeout.ms (the
	// minimum is 6 s by default), else joining the group fails. Default
	// SessionTimeoutDefault (10 s); the heartbeat interval follows (see
	// GroupOpts).
	SessionTimeout time.Duration
	// KgoOpts are appended to the client options (they win).
	KgoOpts []kgo.Opt
}

func (cfg SourceConfig) withDefaults() SourceConfig {
	cfg.CommitInterval = cmp.Or(cfg.CommitInterval, CommitIntervalDefault)
	cfg.MaxHeld = cmp.Or(cfg.MaxHeld, MaxHeldDefault)
	cfg.TopicPartitions = cmp.Or(cfg.TopicPartitions, PartitionsDefault)
	cfg.SessionTimeout = cmp.Or(cfg.SessionTimeout, SessionTimeoutDefault)
	return cfg
}

// Source is the Kafka half of a consumer (transport.Source): a member of a
// consumer group on the domain topics and their .retry topics. Records of a
// domain partition are handed to the pipeline in offset order, BatchSize at
// a time, one partition's batch at a time; records of a retry partition are
// held until their no_abans and handed over as they come due. Offsets are
// committed in the background, only over finished records: a record is
// finished when the pipeline returned it done, or when its .retry/.dlq copy
// is confirmed by the broker (acks=all). Build it with NewSource and give it
// to consumer.Config.Source.
type Source struct {
	cfg     SourceConfig
	p       transport.Pipeline
	set     transport.PipelineSettings
	log     *slog.Logger
	retryOf map[string]string

	cl *kgo.Client

	mu    sync.Mutex
	parts map[tp]*partition

	rebalanceMu sync.Mutex // one revoke/lost/shutdown at a time
	commitMu    sync.Mutex // commits are serialised, so offsets never go back
	commitWake  chan struct{}

	workCtx    context.Context // handlers and transactions; cancelled on crash or past the shutdown timeout
	workCancel context.CancelFunc
}

type tp struct {
	topic string
	part  int32
}

var _ transport.Source = (*Source)(nil)

// NewSource checks cfg (with its defaults) and returns a Kafka source for
// it, as amqp.NewSource does: an invalid cfg is an error naming every
// problem. It does not connect: the consumer's Run does.
func NewSource(cfg SourceConfig) (*Source, error) {
	cfg = cfg.withDefaults()
	s := &Source{cfg: cfg, retryOf: map[string]string{}, parts: map[tp]*partition{}, commitWake: make(chan struct{}, 1)}
	if err := s.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: source: %w", err)
	}
	for _, t := range cfg.Topics {
		s.retryOf[contract.RetryTopic(t)] = t
	}
	return s, nil
}

// Config returns the source's configuration, with its defaults.
func (s *Source) Config() SourceConfig { return s.cfg }

// Label returns the consumer group.
func (s *Source) Label() string { return s.cfg.Group }

// Validate reports what is wrong with the source's configuration.
func (s *Source) Validate() error {
	cfg := s.cfg
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if len(cfg.Brokers) == 0 {
		bad("no Brokers")
	}
	if cfg.Group == "" {
		bad("no Group")
	}
	if len(cfg.Topics) == 0 {
		bad("no Topics")
	}
	seen := map[string]bool{}
	for _, t := range cfg.Topics {
		switch {
		case t == "":
			bad("empty topic name")
		case strings.HasSuffix(t, contract.RetrySuffix), strings.HasSuffix(t, contract.DLQSuffix):
			bad("topic %q: list domain topics; their %s and %s topics are derived", t, contract.RetrySuffix, contract.DLQSuffix)
		case seen[t]:
			bad("topic %q listed twice", t)
		case CheckTopic(contract.RetryTopic(t)) != nil:
			bad("%v (with its %s suffix)", CheckTopic(contract.RetryTopic(t)), contract.RetrySuffix)
		}
		seen[t] = true
	}
	for name, d := range map[string]time.Duration{"CommitInterval": cfg.CommitInterval, "SessionTimeout": cfg.SessionTimeout} {
		if d < 0 {
			bad("negative %s %v", name, d)
		}
	}
	if cfg.MaxHeld < 1 {
		bad("MaxHeld %d < 1", cfg.MaxHeld)
	}
	if cfg.TopicPartitions < 1 {
		bad("TopicPartitions %d < 1", cfg.TopicPartitions)
	}
	return errors.Join(errs...)
}

// fetchMaxWait is how long the broker may hold an empty fetch; see Run.
const fetchMaxWait = 250 * time.Millisecond

// errRunTwice is returned by a second Run of one Source.
var errRunTwice = errors.New("kafka: a Source runs in one consumer only")

// Run joins the group and hands records to p until ctx is done. Then it
// stops fetching, lets in-flight batches finish, commits the offsets of
// finished work, leaves the group and returns nil, all within the
// pipeline's ShutdownTimeout (plus at most a second for the leave): past it
// in-flight work is abandoned (rolled back, redelivered later) and a leave
// still waiting for a rebalance is given up (the broker then drops the member
// at its session timeout). It returns an error if the client cannot be
// created or the .retry/.dlq topics cannot be ensured, and an error wrapping
// the pipeline's crash error after a crash point fired (then nothing more was
// committed).
func (s *Source) Run(ctx context.Context, p transport.Pipeline) error {
	if s.p != nil {
		return errRunTwice
	}
	s.p, s.set = p, p.Settings()
	s.log = s.set.Logger
	if s.log == nil {
		s.log = slog.Default()
	}
	s.workCtx, s.workCancel = context.WithCancel(context.WithoutCancel(ctx))
	defer s.workCancel()
	go func() {
		select {
		case <-p.Crashed():
			s.workCancel()
		case <-s.workCtx.Done():
		}
	}()
	// The client's own context: cancelled only to stop a leave that would
	// wait for a pending rebalance (see closeClient).
	clientCtx, cancelClient := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelClient()

	topics := append([]string(nil), s.cfg.Topics...)
	for rt := range s.retryOf {
		topics = append(topics, rt)
	}
	opts := append(ProducerOpts(),
		kgo.WithContext(clientCtx),
		kgo.SeedBrokers(s.cfg.Brokers...),
		kgo.ConsumerGroup(s.cfg.Group),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		// A resumed partition is fetched again only after the fetch in
		// flight returns; keep that wait short (kgo's default is 5 s).
		kgo.FetchMaxWait(fetchMaxWait),
		kgo.OnPartitionsRevoked(s.revoked),
		kgo.OnPartitionsLost(s.lost),
	)
	opts = append(opts, GroupOpts(s.cfg.SessionTimeout)...)
	opts = append(opts, s.cfg.KgoOpts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("consumer: kafka client: %w", err)
	}
	s.cl = cl
	if !s.cfg.NoCreateTopics {
		var derived []string
		var specs []TopicSpec
		for _, t := range s.cfg.Topics {
			for _, d := range []string{contract.RetryTopic(t), contract.DLQName(t)} {
				derived = append(derived, d)
				specs = append(specs, s.cfg.TopicSettings.Spec(d, s.cfg.TopicPartitions))
			}
		}
		if err := EnsureTopicSpecs(ctx, cl, nil, specs...); err != nil {
			cl.Close()
			return fmt.Errorf("consumer: ensure %v: %w", derived, err)
		}
	}
	// The group client subscribes only now that the .retry topics exist: a
	// member that found a consumed topic later (at the first copy's metadata
	// refresh) would rejoin the group mid-run, pausing every partition.
	cl.AddConsumeTopics(topics...)

	commitCtx, stopCommitter := context.WithCancel(s.workCtx)
	committerDone := make(chan struct{})
	go func() { defer close(committerDone); s.committer(commitCtx) }()

	s.poll(ctx)

	deadline := time.Now().Add(s.set.ShutdownTimeout)
	if s.crashed() {
		s.stopAll(false)
		stopCommitter()
		<-committerDone
		s.closeClient(deadline, cancelClient) // our revoke callback does nothing once crashed
		return p.Err()
	}
	grace := time.AfterFunc(s.set.ShutdownTimeout, func() {
		s.log.Warn("consumer: shutdown timeout; abandoning in-flight work", "timeout", s.set.ShutdownTimeout)
		s.workCancel()
	})
	s.stopAll(true)
	grace.Stop()
	stopCommitter()
	<-committerDone
	s.closeClient(deadline, cancelClient)
	if s.crashed() {
		return p.Err()
	}
	return nil
}

// crashed reports whether a crash point killed the consumer.
func (s *Source) crashed() bool { return s.p.Err() != nil }

// leaveMin is the least time closeClient gives the group leave.
const leaveMin = time.Second

// closeClient closes the client, which leaves the group. kgo's leave first
// waits for a JoinGroup in flight, and a broker holds a JoinGroup until every
// member it knows rejoins: with a member that died without leaving, that is
// until the broker expires it, longer than a stop may take. So at deadline (at
// least leaveMin from now) the client's context is cancelled: the JoinGroup
// fails, the client closes without sending the leave, and the broker drops
// this member at its session timeout instead.
func (s *Source) closeClient(deadline time.Time, cancelClient context.CancelFunc) {
	wait := max(time.Until(deadline), leaveMin)
	t := time.AfterFunc(wait, func() {
		s.log.Warn("consumer: leaving the group is waiting for a rebalance; closing without leaving", "waited", wait)
		cancelClient()
	})
	defer t.Stop()
	s.cl.Close()
}

// poll fetches and hands records to their partition workers until ctx is
// done or the consumer crashed. Dispatch never blocks: a partition whose
// queue is full is paused instead.
func (s *Source) poll(ctx context.Context) {
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.p.Crashed():
			cancel()
		case <-pctx.Done():
		}
	}()
	maxPoll := min(8*s.set.BatchSize, 4096) // records handed out per poll, over all partitions
	for {
		fs := s.cl.PollRecords(pctx, maxPoll)
		if pctx.Err() != nil || fs.IsClientClosed() {
			s.cl.AllowRebalance()
			return
		}
		if errs := fs.Errors(); len(errs) > 0 {
			for _, e := range errs {
				if !errors.Is(e.Err, context.Canceled) {
					s.log.Warn("consumer: fetch", "topic", e.Topic, "partition", e.Partition, "err", e.Err)
				}
			}
		}
		fs.EachPartition(func(f kgo.FetchTopicPartition) {
			if len(f.Records) > 0 {
				s.partitionFor(f.Topic, f.Partition).push(f.Records, f.HighWatermark)
			}
		})
		s.cl.AllowRebalance()
		if fs.NumRecords() == 0 && len(fs.Errors()) > 0 { // do not spin on a broker that only answers errors
			select {
			case <-pctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// partitionFor returns the worker of (topic, part), starting it if needed.
func (s *Source) partitionFor(topic string, part int32) *partition {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := tp{topic, part}
	p := s.parts[k]
	if p == nil {
		p = newPartition(s, topic, part)
		s.parts[k] = p
		go p.run()
	}
	return p
}

// revoked runs when the group takes partitions away: their workers finish
// the batch in hand, drop what is queued, and their offsets are committed
// before the rebalance proceeds, so the next owner starts where we stopped.
func (s *Source) revoked(ctx context.Context, _ *kgo.Client, m map[string][]int32) {
	s.detachAndStop(ctx, m, true)
}

// lost runs when the partitions were lost (session expired): the workers
// stop, and nothing is committed, since another member may own them now.
func (s *Source) lost(ctx context.Context, _ *kgo.Client, m map[string][]int32) {
	s.detachAndStop(ctx, m, false)
}

func (s *Source) detachAndStop(ctx context.Context, m map[string][]int32, commit bool) {
	if s.crashed() {
		return
	}
	s.rebalanceMu.Lock()
	defer s.rebalanceMu.Unlock()
	var gone []*partition
	s.mu.Lock()
	for t, ps := range m {
		for _, p := range ps {
			if w := s.parts[tp{t, p}]; w != nil {
				delete(s.parts, tp{t, p})
				gone = append(gone, w)
			}
		}
	}
	s.mu.Unlock()
	s.stopParts(gone)
	if commit && len(gone) > 0 {
		if err := s.commit(ctx, gone); err != nil && !s.crashed() {
			s.log.Warn("consumer: commit on revoke", "err", err)
		}
	}
	resume := map[string][]int32{}
	for _, p := range gone {
		resume[p.topic] = append(resume[p.topic], p.part)
	}
	if len(resume) > 0 {
		s.cl.ResumeFetchPartitions(resume) // a paused partition stays paused in the client otherwise
	}
}

// stopAll stops every worker; with commit, it commits what they finished.
func (s *Source) stopAll(commit bool) {
	s.rebalanceMu.Lock()
	defer s.rebalanceMu.Unlock()
	s.mu.Lock()
	all := make([]*partition, 0, len(s.parts))
	for k, p := range s.parts {
		all = append(all, p)
		delete(s.parts, k)
	}
	s.mu.Unlock()
	s.stopParts(all)
	if commit && !s.crashed() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(s.workCtx), 10*time.Second)
		defer cancel()
		if err := s.commit(ctx, all); err != nil && !s.crashed() {
			s.log.Warn("consumer: final commit", "err", err)
		}
	}
}

func (s *Source) stopParts(ps []*partition) {
	for _, p := range ps {
		p.stop()
	}
	for _, p := range ps {
		<-p.done
		s.p.Lag(p.topic, p.part, -1, time.Time{}) // no longer ours: its lag is the next owner's
	}
}

// wakeCommitter asks the committer for a commit soon.
func (s *Source) wakeCommitter() {
	select {
	case s.commitWake <- struct{}{}:
	default:
	}
}

// committer commits the offsets of finished work in the background, at most
// once per CommitInterval, so commits cost little at full rate and come at
// once when idle.
func (s *Source) committer(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.commitWake:
		}
		s.mu.Lock()
		ps := make([]*partition, 0, len(s.parts))
		for _, p := range s.parts {
			ps = append(ps, p)
		}
		s.mu.Unlock()
		if err := s.commit(ctx, ps); err != nil && ctx.Err() == nil && !s.crashed() {
			s.log.Warn("consumer: commit", "err", err)
			s.wakeCommitter() // try again after the interval
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(s.cfg.CommitInterval):
		}
	}
}

// errCrashedNoCommit is commit's error once the consumer crashed.
var errCrashedNoCommit = errors.New("kafka: consumer crashed; no commit")

// commit synchronously commits the committable offsets of ps that moved since
// their last commit. Commits are serialised and offsets only grow, so a commit
// never moves a partition back.
func (s *Source) commit(ctx context.Context, ps []*partition) error {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	if s.crashed() {
		return errCrashedNoCommit
	}
	offsets := map[string]map[int32]kgo.EpochOffset{}
	var moved []*partition
	var marks []kgo.EpochOffset
	for _, p := range ps {
		mark, ok := p.committable()
		if !ok {
			continue
		}
		if offsets[p.topic] == nil {
			offsets[p.topic] = map[int32]kgo.EpochOffset{}
		}
		offsets[p.topic][p.part] = mark
		moved = append(moved, p)
		marks = append(marks, mark)
	}
	if len(moved) == 0 {
		return nil
	}
	var cerr error
	s.cl.CommitOffsetsSync(ctx, offsets, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		cerr = commitError(resp, err)
	})
	if cerr != nil {
		return fmt.Errorf("consumer: offset commit: %w", cerr)
	}
	for i, p := range moved {
		p.committed(marks[i])
	}
	return nil
}

func commitError(resp *kmsg.OffsetCommitResponse, err error) error {
	if err != nil {
		return err
	}
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return fmt.Errorf("%s[%d]: %w", t.Topic, p.Partition, err)
			}
		}
	}
	return nil
}

// Span names a record in the consumer's trace span: the topic it was read
// from (a .retry topic for a retry copy) and the consumer group.
func (s *Source) Span(topic, _ string) transport.SpanNames {
	return transport.SpanNames{System: "kafka", Destination: topic, Group: s.cfg.Group}
}

// KeyOrder reports that a key's records reach one lane in their order: the
// partition the key hashes to (consumer.PerKey relies on it).
func (s *Source) KeyOrder() error { return nil }
