// Package kafkatest starts an in-process kfake broker per test and reads
// topics back for assertions.
package kafkatest

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
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

// ReadTopic reads every record topic holds now: it lists the partitions'
// end offsets first, then reads until each partition reaches its end, so
// the count is exact (a duplicate shows as an extra record) without a
// quiet window to wait out. It fails the test if timeout passes first (a
// loaded machine may need seconds before the first fetch: give it tens).
func ReadTopic(t testing.TB, b *kafkaembed.Broker, topic string, timeout time.Duration) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	adm := kadm.NewClient(Client(t, b))
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		t.Fatalf("kafkatest: end offsets of %s: %v", topic, err)
	}
	want := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Err != nil {
			t.Fatalf("kafkatest: end offset of %s/%d: %v", topic, o.Partition, o.Err)
		}
		if o.Offset > 0 {
			want[o.Partition] = o.Offset
		}
	})
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.Addrs()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var out []*kgo.Record
	for len(want) > 0 {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("kafkatest: %s: %d records read in %v, partitions not read to their end: %v", topic, len(out), timeout, want)
		}
		fs.EachRecord(func(r *kgo.Record) {
			out = append(out, r)
			if end, ok := want[r.Partition]; ok && r.Offset+1 >= end {
				delete(want, r.Partition)
			}
		})
	}
	return out
}
