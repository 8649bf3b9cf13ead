package kafkadlq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/pause"
	"github.com/km0/km0/transport/kafka"
)

// Defaults of IndexerConfig.
const (
	MetadataMaxAgeDefault = 10 * time.Second
	RetryBackoffDefault   = time.Second
	retryBackoffMax       = 30 * time.Second
)

// IndexerConfig configures an Indexer.
type IndexerConfig struct {
	Kafka Config     // brokers, topics or pattern, group (default km0.dlq.index)
	Store *dlq.Store // required
	// Alerter gets every letter indexed for the first time; nil = no alerts
	// (do not run an Indexer without one in production).
	Alerter *dlq.Alerter
	// MetadataMaxAge is how soon a new DLQ topic matching the pattern is
	// noticed. Default 10 s.
	MetadataMaxAge time.Duration
	// RetryBackoff is the first wait after a database error before the same
	// batch is indexed again (doubling, at most 30 s, jittered down by up to
	// a half). Default 1 s.
	RetryBackoff time.Duration
}

// Indexer keeps the index current: a member of its own consumer group
// (default km0.dlq.index) on the DLQ topics that indexes each batch of
// records in one transaction and commits the batch's offsets only after that
// transaction committed. A crash in between re-reads the batch, and indexing
// it again changes nothing (ON CONFLICT DO NOTHING) and alerts nothing.
type Indexer struct {
	cfg IndexerConfig
	log *slog.Logger
	cl  *kgo.Client
}

// NewIndexer returns an Indexer; Run starts it. It fails without a Store or
// brokers, or for a bad topic pattern.
func NewIndexer(cfg IndexerConfig) (*Indexer, error) {
	if cfg.Store == nil {
		return nil, errors.New("kafkadlq: IndexerConfig needs a Store")
	}
	k, _, err := cfg.Kafka.withDefaults()
	if err != nil {
		return nil, err
	}
	cfg.Kafka = k
	if cfg.MetadataMaxAge <= 0 {
		cfg.MetadataMaxAge = MetadataMaxAgeDefault
	}
	if cfg.RetryBackoff <= 0 {
		cfg.RetryBackoff = RetryBackoffDefault
	}
	// The group's session timeout and heartbeat are km0's defaults
	// (kafka.GroupOpts); Kafka.ClientOpts, applied last, may override them.
	opts := []kgo.Opt{
		kgo.SeedBrokers(k.Brokers...), kgo.ConsumerGroup(k.Group),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.MetadataMaxAge(cfg.MetadataMaxAge),
		kgo.AdjustFetchOffsetsFn(func(ctx context.Context, offs map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
			if err := startNoLaterThanIndexed(ctx, cfg.Store, offs); err != nil {
				// The index is unreachable: start from the group's offsets;
				// nothing is committed until the index takes the letters.
				k.Logger.Warn("dlq: indexer cannot read the index's offsets; starting from the group's", "err", err)
			}
			return offs, nil
		}),
	}
	opts = append(opts, kafka.GroupOpts(0)...)
	if len(k.Topics) > 0 {
		opts = append(opts, kgo.ConsumeTopics(k.Topics...))
	} else {
		opts = append(opts, kgo.ConsumeTopics(k.TopicPattern), kgo.ConsumeRegex())
	}
	cl, err := kgo.NewClient(append(opts, k.ClientOpts...)...)
	if err != nil {
		return nil, fmt.Errorf("dlq: indexer client: %w", err)
	}
	return &Indexer{cfg: cfg, log: k.Logger, cl: cl}, nil
}

// Run indexes until ctx ends, then leaves the group and returns nil. A
// database error does not skip letters: the batch is retried, with backoff,
// until it is indexed (its offsets stay uncommitted meanwhile). A letter the
// index refuses for what it holds is not such an error: Store.Insert sets
// it aside (cartes_refusades), Run raises its alert once (Alerter.Refused,
// or an error line without an Alerter) and goes on with the letters behind
// it.
func (ix *Indexer) Run(ctx context.Context) error {
	defer ix.cl.Close()
	for {
		fs := ix.cl.PollFetches(ctx)
		if ctx.Err() != nil || fs.IsClientClosed() {
			ix.cl.AllowRebalance()
			return nil
		}
		fs.EachError(func(t string, p int32, err error) {
			ix.log.Warn("dlq: indexer fetch", "topic", t, "partition", p, "err", err)
		})
		recs := fs.Records()
		if len(recs) == 0 {
			ix.cl.AllowRebalance()
			continue
		}
		added, refused, err := ix.index(ctx, lettersOf(recs))
		if err != nil {
			ix.cl.AllowRebalance()
			return nil // ctx ended while the database was down; nothing committed
		}
		if ix.cfg.Alerter != nil {
			for _, l := range added {
				ix.cfg.Alerter.DeadLetter(ctx, l)
			}
		}
		dlq.ReportRefused(ctx, ix.cfg.Alerter, ix.log, refused)
		if err := ix.cl.CommitRecords(ctx, recs...); err != nil {
			ix.log.Warn("dlq: indexer commit (the batch will be read again, harmlessly)", "err", err)
		}
		ix.cl.AllowRebalance()
	}
}

func (ix *Indexer) index(ctx context.Context, letters []*dlq.Letter) (added []*dlq.Letter, refused []dlq.Refusal, err error) {
	for fails := 1; ; fails++ {
		added, refused, err := ix.cfg.Store.Index(ctx, letters)
		if err == nil {
			return added, refused, nil
		}
		ix.log.Error("dlq: indexer cannot write the index; retrying the batch", "letters", len(letters), "err", err)
		t := time.NewTimer(pause.Backoff(ix.cfg.RetryBackoff, retryBackoffMax, fails))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, nil, ctx.Err()
		case <-t.C:
		}
	}
}

// startNoLaterThanIndexed moves each partition's start back to the offset
// after the highest letter this index holds (the log start if it holds
// none), where the group's committed offset is later: another reader of the
// group, writing another index, may have moved it past letters this index
// never got. Reading them again is harmless: Insert skips letters it has.
func startNoLaterThanIndexed(ctx context.Context, st *dlq.Store, offs map[string]map[int32]kgo.Offset) error {
	topics := make([]string, 0, len(offs))
	for t := range offs {
		topics = append(topics, t)
	}
	indexed, err := st.IndexedNext(ctx, topics)
	if err != nil {
		return err
	}
	for t, ps := range offs {
		for p, o := range ps {
			committed := o.EpochOffset().Offset
			if committed < 0 { // nothing committed: the reset offset (the start) applies
				continue
			}
			if next, ok := indexed[tp{Topic: t, Partition: p}]; !ok {
				ps[p] = kgo.NewOffset().AtStart()
			} else if next < committed {
				ps[p] = kgo.NewOffset().At(next)
			}
		}
	}
	return nil
}
