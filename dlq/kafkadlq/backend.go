// Package kafkadlq is the Kafka Backend of package dlq: the `<topic>.dlq`
// topics of CONTRACT.md, indexed into a dlq.Store by Sync or by an Indexer
// (a member of its own consumer group), and replays through a confirmed
// producer.
package kafkadlq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// Defaults of Config.
const (
	// GroupDefault is the consumer group of the indexer; Sync reads and
	// advances its committed offsets too.
	GroupDefault = "km0.dlq.index"
	// TopicPatternDefault selects every DLQ topic.
	TopicPatternDefault = `\.dlq$`
)

// Config configures a Backend and an Indexer.
type Config struct {
	// Brokers are the bootstrap brokers. Required.
	Brokers []string
	// Topics are the DLQ topics. Empty: every topic matching TopicPattern.
	Topics []string
	// TopicPattern is a regular expression for DLQ topics. Default `\.dlq$`.
	TopicPattern string
	// Group is the consumer group whose offsets mark what is indexed.
	// Default "km0.dlq.index".
	Group string
	// SyncTimeout bounds one Sync. Default dlq.SyncTimeoutDefault (30 s).
	SyncTimeout time.Duration
	// Logger; default slog.Default().
	Logger *slog.Logger
	// ClientOpts are extra franz-go options (TLS, SASL) for every client.
	ClientOpts []kgo.Opt
}

func (c Config) withDefaults() (Config, *regexp.Regexp, error) {
	if len(c.Brokers) == 0 {
		return c, nil, errors.New("dlq: no Kafka brokers")
	}
	if c.TopicPattern == "" {
		c.TopicPattern = TopicPatternDefault
	}
	if c.Group == "" {
		c.Group = GroupDefault
	}
	if c.SyncTimeout <= 0 {
		c.SyncTimeout = dlq.SyncTimeoutDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	re, err := regexp.Compile(c.TopicPattern)
	if err != nil {
		return c, nil, fmt.Errorf("dlq: topic pattern: %w", err)
	}
	return c, re, nil
}

// Backend is the dlq.Backend of the `<topic>.dlq` topics of CONTRACT.md.
type Backend struct {
	cfg Config
	re  *regexp.Regexp
	cl  *kgo.Client
	adm *kadm.Client
	pub *kafka.Publisher
}

var _ dlq.Backend = (*Backend)(nil)

// New connects a producer/admin client (acks=all, as every km0
// producer). It fails for a missing broker list or a bad pattern; the
// brokers are first contacted by the first call that needs them.
func New(cfg Config) (*Backend, error) {
	cfg, re, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	cl, err := kafka.NewClient(cfg.Brokers, cfg.ClientOpts...)
	if err != nil {
		return nil, err
	}
	return &Backend{cfg: cfg, re: re, cl: cl, adm: kadm.NewClient(cl), pub: kafka.NewPublisher(cl)}, nil
}

// Close closes the client.
func (b *Backend) Close() { b.cl.Close() }

// Publish implements dlq.Backend: a confirmed publish (acks=all). A message
// addressed to one consumer group (header grup_consumidor) goes to
// <topic>.retry as a retry copy of that group, due now (intents 1, no
// no_abans): every group's source reads the retry topic and skips the copies
// of another group (transport.Pipeline.Foreign), so no other group sees the
// replay. A message without the header goes to the topic itself.
func (b *Backend) Publish(ctx context.Context, msgs []*transport.Message) error {
	out := make([]*transport.Message, len(msgs))
	for i, m := range msgs {
		g, _ := m.Header(contract.HeaderGroup)
		if g == "" {
			out[i] = m
			continue
		}
		c := *m
		c.Topic = contract.RetryTopic(m.Topic)
		c.Headers = append([]transport.Header(nil), m.Headers...)
		c.SetHeader(contract.HeaderAttempts, "1")
		out[i] = &c
	}
	return b.pub.Publish(ctx, out)
}

// topics returns the DLQ topics: Config.Topics, or the existing topics
// matching TopicPattern, sorted.
func (b *Backend) topics(ctx context.Context) ([]string, error) {
	if len(b.cfg.Topics) > 0 {
		return b.cfg.Topics, nil
	}
	details, err := b.adm.ListTopics(ctx)
	if err != nil {
		return nil, fmt.Errorf("dlq: list topics: %w", err)
	}
	var out []string
	for _, t := range details.Names() {
		if b.re.MatchString(t) {
			out = append(out, t)
		}
	}
	sort.Strings(out)
	return out, nil
}

// Sync implements dlq.Backend. It reads every DLQ partition from the group's
// committed offset (or the log start) up to the end offset it had when Sync
// began, indexes what it read (batch by batch, each in one transaction), and
// then commits the offsets it reached for the group when the group has no
// active member (a running Indexer owns the commits otherwise; re-reading is
// harmless because indexing is idempotent). Control records of transactional
// producers are read (so the end is always reached) and not indexed. It fails
// after SyncTimeout, naming the partitions it did not finish; what it had
// indexed stays indexed.
func (b *Backend) Sync(ctx context.Context, s *dlq.Store) (dlq.SyncResult, error) {
	var res dlq.SyncResult
	ctx, cancel := context.WithTimeout(ctx, b.cfg.SyncTimeout)
	defer cancel()
	topics, err := b.topics(ctx)
	if err != nil || len(topics) == 0 {
		return res, err
	}
	indexed, err := s.IndexedNext(ctx, topics)
	if err != nil {
		return res, err
	}
	from, target, committed, err := b.syncPlan(ctx, topics, indexed)
	if err != nil || len(target) == 0 {
		return res, err
	}
	opts := append([]kgo.Opt{kgo.SeedBrokers(b.cfg.Brokers...), kgo.ConsumePartitions(from),
		kgo.KeepControlRecords(), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(200 * time.Millisecond)}, b.cfg.ClientOpts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return res, fmt.Errorf("dlq: sync client: %w", err)
	}
	defer cl.Close()
	next := map[tp]int64{}
	for len(target) > 0 {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			return res, fmt.Errorf("dlq: sync did not reach the end of %s: %w", describe(target, next), ctx.Err())
		}
		var ferr error
		fs.EachError(func(t string, p int32, err error) {
			ferr = errors.Join(ferr, fmt.Errorf("%s/%d: %w", t, p, err))
		})
		if ferr != nil {
			return res, fmt.Errorf("dlq: sync fetch: %w", ferr)
		}
		recs := fs.Records()
		for _, r := range recs {
			k := tp{Topic: r.Topic, Partition: r.Partition}
			next[k] = r.Offset + 1
			if end, ok := target[k]; ok && next[k] >= end {
				delete(target, k)
			}
		}
		added, refused, err := s.Index(ctx, lettersOf(recs))
		if err != nil {
			return res, err
		}
		res.Read += len(recs)
		res.New = append(res.New, added...)
		res.Refused = append(res.Refused, refused...)
	}
	b.commitReached(ctx, next, committed)
	return res, nil
}

// syncPlan returns where to start reading each partition, the end offset to
// reach for partitions with something to read, and the committed offsets.
func (b *Backend) syncPlan(ctx context.Context, topics []string, indexed map[tp]int64) (map[string]map[int32]kgo.Offset, map[tp]int64, map[tp]int64, error) {
	ends, err := b.adm.ListEndOffsets(ctx, topics...)
	if err == nil {
		err = listedError(ends)
	}
	if err != nil {
		return nil, nil, nil, fmt.Errorf("dlq: end offsets: %w", err)
	}
	starts, err := b.adm.ListStartOffsets(ctx, topics...)
	if err == nil {
		err = listedError(starts)
	}
	if err != nil {
		return nil, nil, nil, fmt.Errorf("dlq: start offsets: %w", err)
	}
	committed := map[tp]int64{}
	if offs, err := b.adm.FetchOffsetsForTopics(ctx, b.cfg.Group, topics...); err == nil {
		offs.Each(func(o kadm.OffsetResponse) {
			if o.Err == nil && o.At >= 0 {
				committed[tp{Topic: o.Topic, Partition: o.Partition}] = o.At
			}
		})
	} else {
		b.cfg.Logger.Debug("dlq: no committed offsets; reading from the start", "group", b.cfg.Group, "err", err)
	}
	from := map[string]map[int32]kgo.Offset{}
	target := map[tp]int64{}
	ends.Each(func(e kadm.ListedOffset) {
		if e.Err != nil { // a DLQ topic that does not exist (yet): no letters
			return
		}
		k := tp{Topic: e.Topic, Partition: e.Partition}
		at := min(committed[k], indexed[k]) // never past what this index holds (0: nothing yet)
		if s, ok := starts.Lookup(e.Topic, e.Partition); ok && s.Offset > at {
			at = s.Offset
		}
		if at >= e.Offset {
			return
		}
		if from[e.Topic] == nil {
			from[e.Topic] = map[int32]kgo.Offset{}
		}
		from[e.Topic][e.Partition] = kgo.NewOffset().At(at)
		target[k] = e.Offset
	})
	return from, target, committed, nil
}

// listedError is the first error of l other than an unknown topic: a DLQ
// topic named in Config.Topics that nobody has written to yet is empty,
// not a failure.
func listedError(l kadm.ListedOffsets) error {
	var err error
	l.Each(func(o kadm.ListedOffset) {
		if o.Err != nil && !errors.Is(o.Err, kerr.UnknownTopicOrPartition) && err == nil {
			err = fmt.Errorf("%s/%d: %w", o.Topic, o.Partition, o.Err)
		}
	})
	return err
}

// commitReached commits the offsets Sync reached, where they advance the
// group. Kafka accepts a commit from outside the group only while the group
// is empty; when an Indexer is running the commit is refused and that is fine.
func (b *Backend) commitReached(ctx context.Context, next, committed map[tp]int64) {
	offs := kadm.Offsets{}
	for k, n := range next {
		if n > committed[k] {
			offs.Add(kadm.Offset{Topic: k.Topic, Partition: k.Partition, At: n, LeaderEpoch: -1})
		}
	}
	if len(offs) == 0 {
		return
	}
	resp, err := b.adm.CommitOffsets(ctx, b.cfg.Group, offs)
	if err == nil {
		err = resp.Error()
	}
	if err != nil {
		b.cfg.Logger.Debug("dlq: sync offsets not committed (an indexer owns the group?)", "group", b.cfg.Group, "err", err)
	}
}

func describe(target map[tp]int64, next map[tp]int64) string {
	var parts []string
	for k, end := range target {
		parts = append(parts, fmt.Sprintf("%s/%d (at %d of %d)", k.Topic, k.Partition, next[k], end))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// lettersOf converts fetched records, skipping control records.
func lettersOf(recs []*kgo.Record) []*dlq.Letter {
	out := make([]*dlq.Letter, 0, len(recs))
	for _, r := range recs {
		if r.Attrs.IsControl() {
			continue
		}
		out = append(out, dlq.NewLetter(r.Topic, r.Partition, r.Offset, r.Timestamp, kafka.FromRecord(r)))
	}
	return out
}

// DeletePurged implements dlq.Backend with Kafka's DeleteRecords: for each
// partition holding a purged letter, it deletes every record before
// Store.DeletableBefore (the lowest offset still pending, or past the last
// indexed record), so no pending letter and no unindexed record is lost. The
// index keeps the purged letters' bytes. It returns the new start offsets.
func (b *Backend) DeletePurged(ctx context.Context, s *dlq.Store, purged []*dlq.Letter) ([]dlq.Position, error) {
	parts := map[tp]bool{}
	var topics []string
	for _, l := range purged {
		k := tp{Topic: l.Topic, Partition: l.Partition}
		if !parts[k] {
			parts[k] = true
			topics = append(topics, l.Topic)
		}
	}
	bounds, err := s.DeletableBefore(ctx, topics)
	if err != nil {
		return nil, err
	}
	offs := kadm.Offsets{}
	for _, p := range bounds {
		if parts[tp{Topic: p.Topic, Partition: p.Partition}] {
			offs.Add(kadm.Offset{Topic: p.Topic, Partition: p.Partition, At: p.Offset})
		}
	}
	resp, err := b.adm.DeleteRecords(ctx, offs)
	if err != nil {
		return nil, fmt.Errorf("dlq: delete records: %w", err)
	}
	var out []dlq.Position
	var errs error
	for _, ps := range resp {
		for _, r := range ps {
			if r.Err != nil {
				errs = errors.Join(errs, fmt.Errorf("%s/%d: %w", r.Topic, r.Partition, r.Err))
				continue
			}
			out = append(out, dlq.Position{Topic: r.Topic, Partition: r.Partition, Offset: r.LowWatermark})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Topic != out[j].Topic {
			return out[i].Topic < out[j].Topic
		}
		return out[i].Partition < out[j].Partition
	})
	if errs != nil {
		return out, fmt.Errorf("dlq: delete records: %w", errs)
	}
	return out, nil
}

// tp is a partition of a DLQ topic, the key of the offsets Sync tracks.
type tp = dlq.TopicPartition
