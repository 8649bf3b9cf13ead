// Package kafkalag is the Kafka probe of package lag: it lists and
// describes consumer groups (committed offset against the end of each
// partition) and reads the timestamps of their oldest unprocessed records.
// It lives beside transport/kafka, apart from it, so that lag links no
// broker client and transport/kafka does not link lag's dependencies.
package kafkalag

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/lag"
	"github.com/km0/km0/transport/kafka"
)

// Config configures a Probe.
type Config struct {
	// Brokers are the Kafka bootstrap brokers. Required.
	Brokers []string
	// ClientOpts are extra franz-go options (TLS, SASL).
	ClientOpts []kgo.Opt
	// Logger gets the errors of single partitions. Default slog.Default().
	Logger *slog.Logger
}

// Probe is the lag.GroupProbe of a Kafka cluster.
type Probe struct {
	cfg Config
	cl  *kgo.Client
	adm *kadm.Client
}

var _ lag.GroupProbe = (*Probe)(nil)

// New returns a Probe; the brokers are first contacted by its first call.
// It fails without brokers.
func New(cfg Config) (*Probe, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("kafkalag: no Kafka brokers")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cl, err := kafka.NewClient(cfg.Brokers, cfg.ClientOpts...)
	if err != nil {
		return nil, err
	}
	return &Probe{cfg: cfg, cl: cl, adm: kadm.NewClient(cl)}, nil
}

// Close closes the client.
func (p *Probe) Close() { p.cl.Close() }

// ListGroups implements lag.GroupProbe.
func (p *Probe) ListGroups(ctx context.Context) ([]string, error) {
	listed, err := p.adm.ListGroups(ctx)
	if err != nil {
		return nil, err
	}
	return listed.Groups(), nil
}

// Describe implements lag.GroupProbe with kadm's Lag. The error of a single
// partition is logged; the partition is reported with what is known.
func (p *Probe) Describe(ctx context.Context, groups []string) ([]lag.GroupState, error) {
	lags, err := p.adm.Lag(ctx, groups...)
	if err != nil {
		return nil, err
	}
	var out []lag.GroupState
	for _, dl := range lags.Sorted() {
		g := lag.GroupState{Group: dl.Group, State: dl.State, Members: len(dl.Members), Err: dl.Error()}
		if g.Err == nil {
			for _, ml := range dl.Lag.Sorted() {
				if ml.Err != nil {
					p.cfg.Logger.Warn("lag: partition", "group", dl.Group, "topic", ml.Topic, "partition", ml.Partition, "err", ml.Err)
				}
				g.Partitions = append(g.Partitions, lag.PartitionLag{Topic: ml.Topic, Partition: ml.Partition,
					Committed: ml.Commit.At, End: ml.End.Offset, Lag: max(ml.Lag, 0)})
			}
		}
		out = append(out, g)
	}
	return out, nil
}

type part struct {
	topic     string
	partition int32
}

// Oldest implements lag.GroupProbe. One client reads one offset per
// partition, so positions of the same partition (groups at different
// offsets) are read in rounds, until ctx ends.
func (p *Probe) Oldest(ctx context.Context, at []lag.Position) map[lag.Position]time.Time {
	byPart := map[part][]int64{}
	for _, k := range at {
		pk := part{k.Topic, k.Partition}
		byPart[pk] = append(byPart[pk], k.Offset)
	}
	for _, offs := range byPart {
		slices.Sort(offs)
	}
	out := map[lag.Position]time.Time{}
	for round := 0; ctx.Err() == nil; round++ {
		parts := map[string]map[int32]kgo.Offset{}
		pending := map[part]int64{}
		for pk, offs := range byPart {
			if round >= len(offs) {
				continue
			}
			if parts[pk.topic] == nil {
				parts[pk.topic] = map[int32]kgo.Offset{}
			}
			parts[pk.topic][pk.partition] = kgo.NewOffset().At(offs[round])
			pending[pk] = offs[round]
		}
		if len(pending) == 0 {
			break
		}
		opts := append(slices.Clip(p.cfg.ClientOpts), kgo.SeedBrokers(p.cfg.Brokers...), kgo.ConsumePartitions(parts),
			kgo.FetchMaxWait(200*time.Millisecond))
		cl, err := kgo.NewClient(opts...)
		if err != nil {
			p.cfg.Logger.Warn("lag: oldest records", "err", err)
			break
		}
		for len(pending) > 0 && ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			fs.EachRecord(func(r *kgo.Record) {
				pk := part{r.Topic, r.Partition}
				off, ok := pending[pk]
				if !ok || r.Offset < off {
					return
				}
				out[lag.Position{Topic: r.Topic, Partition: r.Partition, Offset: off}] = r.Timestamp
				delete(pending, pk)
			})
		}
		cl.Close()
	}
	return out
}
