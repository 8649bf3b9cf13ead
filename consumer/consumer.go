package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/transport/kafka"
)

// Consumer is one member of a Kafka consumer group that processes each record
// idempotently (see the package doc). Build it with New and start it with Run.
type Consumer struct {
	cfg        Config
	log        *slog.Logger
	m          *metrics
	counts     counters
	types      map[string]bool // nil: every tipus
	retryOf    map[string]string
	insertKeys string // bulk key insert, see batch.go
	sem        chan struct{}

	cl *kgo.Client

	started atomic.Bool

	mu    sync.Mutex
	parts map[tp]*partition

	rebalanceMu sync.Mutex // one revoke/lost/shutdown at a time
	commitMu    sync.Mutex // commits are serialised, so offsets never go back
	commitWake  chan struct{}

	workCtx    context.Context // handlers and transactions; cancelled on crash
	workCancel context.CancelFunc
	crashOnce  sync.Once
	crashed    atomic.Bool
	crashErr   error
	crashCh    chan struct{}
}

type tp struct {
	topic string
	part  int32
}

// New checks cfg (after WithDefaults) and returns a Consumer. It does not
// connect: Run does. A bad config returns an error wrapping ErrConfig.
func New(cfg Config) (*Consumer, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Metrics, cfg)
	if err != nil {
		return nil, err
	}
	c := &Consumer{
		cfg:        cfg,
		log:        cfg.Logger.With("grup", cfg.Group, "consumidor", cfg.Name),
		m:          m,
		retryOf:    map[string]string{},
		insertKeys: bulkInsertSQL(cfg.Inbox.Table()),
		sem:        make(chan struct{}, cfg.Concurrency),
		parts:      map[tp]*partition{},
		commitWake: make(chan struct{}, 1),
		counts:     newCounters(),
		crashCh:    make(chan struct{}),
	}
	if len(cfg.Types) > 0 {
		c.types = map[string]bool{}
		for _, t := range cfg.Types {
			c.types[t] = true
		}
	}
	for _, t := range cfg.Topics {
		c.retryOf[t+RetrySuffix] = t
	}
	return c, nil
}

// fetchMaxWait is how long the broker may hold an empty fetch; see Run.
const fetchMaxWait = 250 * time.Millisecond

// ErrAlreadyRun is returned by a second call of Run.
var ErrAlreadyRun = errors.New("consumer: Run called twice")

// Run joins the group and processes records until ctx is done. Then it stops
// fetching, lets in-flight batches finish, commits the offsets of finished
// work, leaves the group and returns nil, all within ShutdownTimeout (plus at
// most a second for the leave): past it in-flight work is abandoned (rolled
// back, redelivered later) and a leave still waiting for a rebalance is
// given up (the broker then drops the member at its session timeout). It returns an
// error if the client cannot be created or the .retry/.dlq topics cannot be
// ensured, and an error wrapping ErrCrashed after a hook simulated a crash
// (then nothing more was committed).
func (c *Consumer) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return ErrAlreadyRun
	}
	c.workCtx, c.workCancel = context.WithCancel(context.WithoutCancel(ctx))
	defer c.workCancel()
	// The client's own context: cancelled only to stop a leave that would
	// wait for a pending rebalance (see closeClient).
	clientCtx, cancelClient := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelClient()

	topics := append([]string(nil), c.cfg.Topics...)
	for rt := range c.retryOf {
		topics = append(topics, rt)
	}
	opts := append(kafka.ProducerOpts(),
		kgo.WithContext(clientCtx),
		kgo.SeedBrokers(c.cfg.Brokers...),
		kgo.ConsumerGroup(c.cfg.Group),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		// A resumed partition is fetched again only after the fetch in
		// flight returns; keep that wait short (kgo's default is 5 s).
		kgo.FetchMaxWait(fetchMaxWait),
		kgo.OnPartitionsRevoked(c.revoked),
		kgo.OnPartitionsLost(c.lost),
	)
	opts = append(opts, kafka.GroupOpts(c.cfg.SessionTimeout)...)
	opts = append(opts, c.cfg.KgoOpts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("consumer: kafka client: %w", err)
	}
	c.cl = cl
	if !c.cfg.NoCreateTopics {
		var derived []string
		for _, t := range c.cfg.Topics {
			derived = append(derived, t+RetrySuffix, t+DLQSuffix)
		}
		if err := kafka.EnsureTopics(ctx, cl, c.cfg.TopicPartitions, derived...); err != nil {
			cl.Close()
			return fmt.Errorf("consumer: ensure %v: %w", derived, err)
		}
	}
	// The group client subscribes only now that the .retry topics exist: a
	// member that found a consumed topic later (at the first copy's metadata
	// refresh) would rejoin the group mid-run, pausing every partition.
	cl.AddConsumeTopics(topics...)

	commitCtx, stopCommitter := context.WithCancel(c.workCtx)
	committerDone := make(chan struct{})
	go func() { defer close(committerDone); c.committer(commitCtx) }()

	c.poll(ctx)

	deadline := time.Now().Add(c.cfg.ShutdownTimeout)
	if c.crashed.Load() {
		c.stopAll(false)
		stopCommitter()
		<-committerDone
		c.closeClient(deadline, cancelClient) // our revoke callback does nothing once crashed
		return fmt.Errorf("consumer %s: %w", c.cfg.Name, c.crashErr)
	}
	grace := time.AfterFunc(c.cfg.ShutdownTimeout, func() {
		c.log.Warn("consumer: shutdown timeout; abandoning in-flight work", "timeout", c.cfg.ShutdownTimeout)
		c.workCancel()
	})
	c.stopAll(true)
	grace.Stop()
	stopCommitter()
	<-committerDone
	c.closeClient(deadline, cancelClient)
	if c.crashed.Load() {
		return fmt.Errorf("consumer %s: %w", c.cfg.Name, c.crashErr)
	}
	return nil
}

// leaveMin is the least time closeClient gives the group leave.
const leaveMin = time.Second

// closeClient closes the client, which leaves the group. kgo's leave first
// waits for a JoinGroup in flight, and a broker holds a JoinGroup until every
// member it knows rejoins: with a member that died without leaving, that is
// until the broker expires it, longer than a stop may take. So at deadline (at
// least leaveMin from now) the client's context is cancelled: the JoinGroup
// fails, the client closes without sending the leave, and the broker drops
// this member at its session timeout instead.
func (c *Consumer) closeClient(deadline time.Time, cancelClient context.CancelFunc) {
	wait := max(time.Until(deadline), leaveMin)
	t := time.AfterFunc(wait, func() {
		c.log.Warn("consumer: leaving the group is waiting for a rebalance; closing without leaving", "waited", wait)
		cancelClient()
	})
	defer t.Stop()
	c.cl.Close()
}

// poll fetches and hands records to their partition workers until ctx is
// done or the consumer crashed. Dispatch never blocks: a partition whose
// queue is full is paused instead.
func (c *Consumer) poll(ctx context.Context) {
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-c.crashCh:
			cancel()
		case <-pctx.Done():
		}
	}()
	maxPoll := 8 * c.cfg.BatchSize
	for {
		fs := c.cl.PollRecords(pctx, maxPoll)
		if pctx.Err() != nil || fs.IsClientClosed() {
			c.cl.AllowRebalance()
			return
		}
		if errs := fs.Errors(); len(errs) > 0 {
			for _, e := range errs {
				if !errors.Is(e.Err, context.Canceled) {
					c.log.Warn("consumer: fetch", "topic", e.Topic, "partition", e.Partition, "err", e.Err)
				}
			}
		}
		fs.EachPartition(func(f kgo.FetchTopicPartition) {
			if len(f.Records) > 0 {
				c.partitionFor(f.Topic, f.Partition).push(f.Records)
			}
		})
		c.cl.AllowRebalance()
		if fs.NumRecords() == 0 && len(fs.Errors()) > 0 { // do not spin on a broker that only answers errors
			select {
			case <-pctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// partitionFor returns the worker of (topic, part), starting it if needed.
func (c *Consumer) partitionFor(topic string, part int32) *partition {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := tp{topic, part}
	p := c.parts[k]
	if p == nil {
		p = newPartition(c, topic, part)
		c.parts[k] = p
		go p.run()
	}
	return p
}

// revoked runs when the group takes partitions away: their workers finish
// the batch in hand, drop what is queued, and their offsets are committed
// before the rebalance proceeds, so the next owner starts where we stopped.
func (c *Consumer) revoked(ctx context.Context, _ *kgo.Client, m map[string][]int32) {
	c.detachAndStop(ctx, m, true)
}

// lost runs when the partitions were lost (session expired): the workers
// stop, and nothing is committed, since another member may own them now.
func (c *Consumer) lost(ctx context.Context, _ *kgo.Client, m map[string][]int32) {
	c.detachAndStop(ctx, m, false)
}

func (c *Consumer) detachAndStop(ctx context.Context, m map[string][]int32, commit bool) {
	if c.crashed.Load() {
		return
	}
	c.rebalanceMu.Lock()
	defer c.rebalanceMu.Unlock()
	var gone []*partition
	c.mu.Lock()
	for t, ps := range m {
		for _, p := range ps {
			if w := c.parts[tp{t, p}]; w != nil {
				delete(c.parts, tp{t, p})
				gone = append(gone, w)
			}
		}
	}
	c.mu.Unlock()
	c.stopParts(gone)
	if commit && len(gone) > 0 {
		if err := c.commit(ctx, gone); err != nil && !c.crashed.Load() {
			c.log.Warn("consumer: commit on revoke", "err", err)
		}
	}
	resume := map[string][]int32{}
	for _, p := range gone {
		resume[p.topic] = append(resume[p.topic], p.part)
	}
	if len(resume) > 0 {
		c.cl.ResumeFetchPartitions(resume) // a paused partition stays paused in the client otherwise
	}
}

// stopAll stops every worker; with commit, it commits what they finished.
func (c *Consumer) stopAll(commit bool) {
	c.rebalanceMu.Lock()
	defer c.rebalanceMu.Unlock()
	c.mu.Lock()
	all := make([]*partition, 0, len(c.parts))
	for k, p := range c.parts {
		all = append(all, p)
		delete(c.parts, k)
	}
	c.mu.Unlock()
	c.stopParts(all)
	if commit && !c.crashed.Load() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(c.workCtx), 10*time.Second)
		defer cancel()
		if err := c.commit(ctx, all); err != nil && !c.crashed.Load() {
			c.log.Warn("consumer: final commit", "err", err)
		}
	}
}

func (c *Consumer) stopParts(ps []*partition) {
	for _, p := range ps {
		p.stop()
	}
	for _, p := range ps {
		<-p.done
	}
}

// crash kills the consumer as a process death at this point would: no further
// commit, in-flight transactions roll back, Run returns err.
func (c *Consumer) crash(err error) {
	c.crashOnce.Do(func() {
		if !errors.Is(err, ErrCrashed) {
			err = fmt.Errorf("%w: %w", ErrCrashed, err)
		}
		c.crashErr = err
		c.crashed.Store(true)
		c.log.Warn("consumer: crashed (fault injection)", "err", err)
		close(c.crashCh)
		c.workCancel()
	})
}

// wakeCommitter asks the committer for a commit soon.
func (c *Consumer) wakeCommitter() {
	select {
	case c.commitWake <- struct{}{}:
	default:
	}
}

// committer commits the offsets of finished work in the background, at most
// once per CommitInterval, so commits cost little at full rate and come at
// once when idle.
func (c *Consumer) committer(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.commitWake:
		}
		c.mu.Lock()
		ps := make([]*partition, 0, len(c.parts))
		for _, p := range c.parts {
			ps = append(ps, p)
		}
		c.mu.Unlock()
		if err := c.commit(ctx, ps); err != nil && ctx.Err() == nil && !c.crashed.Load() {
			c.log.Warn("consumer: commit", "err", err)
			c.wakeCommitter() // try again after the interval
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(c.cfg.CommitInterval):
		}
	}
}

// commit synchronously commits the committable offsets of ps that moved since
// their last commit. Commits are serialised and offsets only grow, so a commit
// never moves a partition back.
func (c *Consumer) commit(ctx context.Context, ps []*partition) error {
	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	if c.crashed.Load() {
		return ErrCrashed
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
	c.cl.CommitOffsetsSync(ctx, offsets, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
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

// hook runs a fault-injection hook; a non-nil result crashes the consumer.
func (c *Consumer) hook(err error) error {
	if err != nil {
		c.crash(err)
		return c.crashErr
	}
	return nil
}
