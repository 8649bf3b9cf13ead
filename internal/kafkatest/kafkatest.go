// Package kafkatest starts an in-process kfake broker per test and reads
// topics back for assertions.
package kafkatest

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// New starts an embedded broker with topics (6 partitions each), closed at cleanup.
func New(t testing.TB, topics ...string) *kafkaembed.Broker {
	t.Helper()
	return NewWith(t, kafkaembed.Config{Topics: topics})
}

// NewWith starts an embedded broker with cfg, closed at cleanup.
func NewWith(t testing.TB, cfg kafkaembed.Config) *kafkaembed.Broker {
	t.Helper()
	b, err := kafkaembed.Start(cfg)
	if err != nil {
		t.Fatalf("kafkatest: %v", err)
	}
	t.Cleanup(b.Close)
	return b
}

// Client returns a client for b, closed at cleanup.
func Client(t testing.TB, b *kafkaembed.Broker, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kafka.NewClient(b.Addrs(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// ClientFor returns a client for brokers with opts (a secured broker's),
// closed at cleanup.
func ClientFor(t testing.TB, brokers []string, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kafka.NewClient(brokers, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// ReadAll reads topic from the start until it has n records or timeout passes,
// and returns what it read, in partition order (order within a partition kept).
func ReadAll(t testing.TB, b *kafkaembed.Broker, topic string, n int, timeout time.Duration) []*kgo.Record {
	t.Helper()
	return ReadAllWith(t, b, nil, topic, n, timeout)
}

// ReadAllWith is ReadAll with extra client options (a secured broker's,
// see Secure.Opts).
func ReadAllWith(t testing.TB, b *kafkaembed.Broker, opts []kgo.Opt, topic string, n int, timeout time.Duration) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(b.Addrs()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			break
		}
		fs.EachRecord(func(r *kgo.Record) { out = append(out, r) })
	}
	return out
}
