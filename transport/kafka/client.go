package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// PartitionsDefault is the partition count of km0's topics (CONTRACT.md).
const PartitionsDefault = 6

// ProducerOpts are the producer settings km0 relies on: acks=all and the
// idempotent producer (franz-go's defaults, stated here so they cannot drift),
// a short linger for latency, and murmur2 key hashing like the Java client and
// librdkafka, so other programs agree on key → partition.
func ProducerOpts() []kgo.Opt {
	return []kgo.Opt{
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(0),
		kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)),
		kgo.ProducerBatchMaxBytes(1 << 20),
		kgo.MaxBufferedRecords(100_000),
	}
}

// NewClient returns a producer-ready client for brokers (comma separated or a
// list) with ProducerOpts and then extra.
func NewClient(brokers []string, extra ...kgo.Opt) (*kgo.Client, error) {
	if len(brokers) == 0 {
		return nil, errors.New("kafka: no brokers")
	}
	opts := append([]kgo.Opt{kgo.SeedBrokers(brokers...)}, ProducerOpts()...)
	opts = append(opts, extra...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("kafka: client: %w", err)
	}
	return cl, nil
}

// SplitBrokers splits "a:9092,b:9092".
func SplitBrokers(s string) []string {
	var out []string
	for _, b := range strings.Split(s, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}

// ErrTopicRefused wraps a topic name or creation the brokers refuse for good
// (an illegal name, no authorisation, a policy): retrying cannot help.
var ErrTopicRefused = errors.New("kafka: topic refused")

// CheckTopic reports a name Kafka refuses: empty, "." or "..", longer than
// 249 bytes, or with a character other than ASCII letters, digits, '.', '_'
// and '-'. The error wraps ErrTopicRefused.
func CheckTopic(name string) error {
	if name == "" || name == "." || name == ".." || len(name) > 249 {
		return fmt.Errorf("%w: %q: a name is 1 to 249 characters, not \".\" or \"..\"", ErrTopicRefused, name)
	}
	for _, c := range []byte(name) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%w: %q: only ASCII letters, digits, '.', '_' and '-' are legal", ErrTopicRefused, name)
		}
	}
	return nil
}

// EnsureTopics creates the topics that do not exist yet with partitions
// partitions under the zero TopicSettings (the broker's replication factor,
// the contract's retention). Existing topics are left as they are. It is
// EnsureTopicSpecs without a logger; use that to choose the settings.
func EnsureTopics(ctx context.Context, cl *kgo.Client, partitions int32, topics ...string) error {
	specs := make([]TopicSpec, 0, len(topics))
	for _, t := range topics {
		specs = append(specs, TopicSettings{}.Spec(t, partitions))
	}
	return EnsureTopicSpecs(ctx, cl, nil, specs...)
}

// EnsureTopicSpecs creates the topics of specs that do not exist yet, each
// with its partitions, replication factor and configs (retention.ms,
// min.insync.replicas). An existing topic is never changed: each way it
// differs from its spec (TopicSpec.Differences) is logged as a warning on
// log (default slog.Default()), and `km0 doctor` reports it. A name Kafka
// refuses, or a creation refused for good (no authorisation, a policy, a
// replication factor above the brokers' count), is an error wrapping
// ErrTopicRefused; a transient failure is retried about 2 s.
// autoWarned: the small-cluster warning of resolveAutoReplication is logged
// once a process.
var autoWarned atomic.Bool

// resolveAutoReplication gives every spec of byName that asks for
// ReplicationFactorAuto the replication factor the cluster's size allows
// (AutoReplicationFactor) and its min.insync.replicas, warning once when
// that is below ReplicationFactorDefault.
func resolveAutoReplication(ctx context.Context, adm *kadm.Client, log *slog.Logger, byName map[string]TopicSpec) error {
	var rf int16
	for name, s := range byName {
		if s.ReplicationFactor != ReplicationFactorAuto {
			continue
		}
		if rf == 0 {
			md, err := adm.BrokerMetadata(ctx)
			if err != nil {
				return fmt.Errorf("kafka: count the cluster's brokers for the replication factor: %w", err)
			}
			rf = AutoReplicationFactor(len(md.Brokers))
			if rf < ReplicationFactorDefault && autoWarned.CompareAndSwap(false, true) {
				log.Warn("kafka: the cluster has fewer brokers than a production replication factor needs; new topics get one replica per broker (set --kafka-replication-factor to require more)",
					"brokers", len(md.Brokers), "replication_factor", rf, "production", ReplicationFactorDefault)
			}
		}
		s.ReplicationFactor = rf
		if s.MinInsyncReplicas <= 0 {
			s.MinInsyncReplicas = MinInsyncFor(rf)
		}
		byName[name] = s
	}
	return nil
}

func EnsureTopicSpecs(ctx context.Context, cl *kgo.Client, log *slog.Logger, specs ...TopicSpec) error {
	if log == nil {
		log = slog.Default()
	}
	byName := map[string]TopicSpec{}
	for _, s := range specs {
		if err := CheckTopic(s.Name); err != nil {
			return err
		}
		if s.Partitions <= 0 {
			s.Partitions = PartitionsDefault
		}
		byName[s.Name] = s
	}
	adm := kadm.NewClient(cl)
	if err := resolveAutoReplication(ctx, adm, log, byName); err != nil {
		return err
	}
	var existing []string
	var lastErr error
	pending := slices.Sorted(maps.Keys(byName))
	for attempt := 0; attempt < 20 && len(pending) > 0; attempt++ {
		lastErr = nil
		var again []string
		for _, name := range pending {
			s := byName[name]
			rf := s.ReplicationFactor
			if rf <= 0 {
				rf = -1
			}
			resp, err := adm.CreateTopic(ctx, s.Partitions, rf, s.Configs(), name)
			if err == nil {
				err = resp.Err
			}
			switch {
			case err == nil:
			case errors.Is(err, kerr.TopicAlreadyExists):
				existing = append(existing, name)
			default:
				var ke *kerr.Error
				if errors.As(err, &ke) && !ke.Retriable { // refused, not unavailable: asking again changes nothing
					return fmt.Errorf("%w: %s: %w", ErrTopicRefused, name, err)
				}
				lastErr = fmt.Errorf("kafka: create topic %s: %w", name, err)
				again = append(again, name)
			}
		}
		if pending = again; len(pending) == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return errors.Join(ctx.Err(), lastErr)
		case <-time.After(100 * time.Millisecond):
		}
	}
	if lastErr != nil {
		return lastErr
	}
	if len(existing) > 0 {
		warnDifferences(ctx, cl, log, byName, existing)
	}
	return nil
}

// warnDifferences logs, for each existing topic, how it differs from its spec.
// A cluster that cannot be asked (no DescribeConfigs) is said once at info:
// the topic is used as it is either way.
func warnDifferences(ctx context.Context, cl *kgo.Client, log *slog.Logger, specs map[string]TopicSpec, existing []string) {
	have, err := DescribeTopics(ctx, cl, existing...)
	if err != nil {
		log.Info("kafka: existing topics not compared with km0's settings", "topics", strings.Join(existing, ", "), "err", err)
		return
	}
	for _, name := range existing {
		h, ok := have[name]
		if !ok {
			continue
		}
		if diff := specs[name].Differences(h); len(diff) > 0 {
			log.Warn("kafka: existing topic differs from km0's settings; left as it is (km0 doctor reports it, change it with kafka-configs)",
				"topic", name, "differences", strings.Join(diff, "; "))
		}
	}
}

// MaxMessageBytes returns the largest record batch the broker accepts on
// topic: the smaller of the topic's max.message.bytes and the brokers'
// message.max.bytes (a broker may report the topic's default while enforcing
// its own lower limit).
func MaxMessageBytes(ctx context.Context, cl *kgo.Client, topic string) (int, error) {
	adm := kadm.NewClient(cl)
	limit := 0
	take := func(rcs kadm.ResourceConfigs, err error, key string) error {
		if err != nil {
			return err
		}
		for _, rc := range rcs {
			if rc.Err != nil {
				return rc.Err
			}
			for _, c := range rc.Configs {
				if c.Key != key || c.Value == nil {
					continue
				}
				n, err := strconv.Atoi(*c.Value)
				if err != nil {
					return fmt.Errorf("%s %q: %w", key, *c.Value, err)
				}
				if limit == 0 || n < limit {
					limit = n
				}
			}
		}
		return nil
	}
	rcs, err := adm.DescribeTopicConfigs(ctx, topic)
	if err := take(rcs, err, "max.message.bytes"); err != nil {
		return 0, fmt.Errorf("kafka: describe topic %s: %w", topic, err)
	}
	brs, err := adm.DescribeBrokerConfigs(ctx)
	if err := take(brs, err, "message.max.bytes"); err != nil {
		return 0, fmt.Errorf("kafka: describe brokers: %w", err)
	}
	if limit == 0 {
		return 0, fmt.Errorf("kafka: %s: no max.message.bytes in its configs", topic)
	}
	return limit, nil
}
