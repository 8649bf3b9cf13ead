package kafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
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
// partitions (replication factor -1: the broker's default). Existing topics are
// left as they are.
func EnsureTopics(ctx context.Context, cl *kgo.Client, partitions int32, topics ...string) error {
	if partitions <= 0 {
		partitions = PartitionsDefault
	}
	for _, t := range topics {
		if err := CheckTopic(t); err != nil {
			return err
		}
	}
	adm := kadm.NewClient(cl)
	var lastErr error
	for attempt := 0; attempt < 20; attempt++ {
		resp, err := adm.CreateTopics(ctx, partitions, -1, nil, topics...)
		if err == nil {
			lastErr = nil
			for _, r := range resp.Sorted() {
				if r.Err != nil && !errors.Is(r.Err, kerr.TopicAlreadyExists) {
					var ke *kerr.Error
					if errors.As(r.Err, &ke) && !ke.Retriable { // refused, not unavailable: asking again changes nothing
						return fmt.Errorf("%w: %s: %w", ErrTopicRefused, r.Topic, r.Err)
					}
					lastErr = fmt.Errorf("kafka: create topic %s: %w", r.Topic, r.Err)
				}
			}
			if lastErr == nil {
				return nil
			}
		} else {
			lastErr = err
		}
		select {
		case <-ctx.Done():
			return errors.Join(ctx.Err(), lastErr)
		case <-time.After(100 * time.Millisecond):
		}
	}
	return lastErr
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
