package consumer_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer/consumertest"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// TestConsumerConformance runs the consumer suite on the Kafka source,
// against one in-process kfake broker, or against the cluster
// KM0_TEST_KAFKA_BROKERS names (comma-separated host:port list).
func TestConsumerConformance(t *testing.T) {
	t.Parallel()
	brokers := kafka.SplitBrokers(os.Getenv("KM0_TEST_KAFKA_BROKERS"))
	if len(brokers) == 0 {
		brokers = kafkatest.NewWith(t, kafkaembed.Config{GroupMinSessionTimeout: time.Second}).Addrs()
	}
	runKafkaConformance(t, brokers, nil, 10_000)
}

// TestConsumerConformanceSecured runs the consumer suite on the Kafka
// source against kfake with SASL SCRAM-SHA-512 over TLS (a test CA), every
// client built with kafka.Security's options (SourceConfig.KgoOpts for the
// source), and with SASL PLAIN the cases that use every client the consumer
// builds (source, retry and dead-letter producers, admin): the mechanism
// changes only how they log in. The per-key case over many keys runs at its
// default size here: the full size runs above.
func TestConsumerConformanceSecured(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		cfg  kafkatest.SecureConfig
		only []string
	}{
		{cfg: kafkatest.SecureConfig{Mechanism: kafka.SASLScramSHA512, TLS: true, GroupMinSessionTimeout: time.Second}},
		{cfg: kafkatest.SecureConfig{Mechanism: kafka.SASLPlain, GroupMinSessionTimeout: time.Second},
			only: []string{"TransientIsRetriedWithBackoffThenDeadLetteredWithTheContractHeaders", "CrashAfterRetryCopyBeforeSettleAppliesOnce",
				"PoisonIsDeadLetteredAtTheFirstAttempt", "OrderPerKeyIsKept", "PerKeyDeadHeadDeadLettersTheSequenceAndItsReplayReleasesIt"}},
	} {
		t.Run(c.cfg.Mechanism, func(t *testing.T) {
			t.Parallel()
			b := kafkatest.NewSecure(t, c.cfg)
			runKafkaConformance(t, b.Addrs(), b.Opts(t), 0, c.only...)
		})
	}
}

func runKafkaConformance(t *testing.T, brokers []string, sec []kgo.Opt, perKeyEvents int, only ...string) {
	admCl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...)}, sec...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admCl.Close)
	consumertest.Run(t, consumertest.Harness{
		Features: consumertest.Features{RepeatedHeaders: true, OrderPerKey: true, PermanentLettersCarryReason: true, PerKeyEvents: perKeyEvents},
		New:      func(t *testing.T) consumertest.Broker { return kafkaBroker(t, brokers, sec, admCl) },
		Only:     only,
	})
}

func kafkaBroker(t *testing.T, brokers []string, sec []kgo.Opt, admCl *kgo.Client) consumertest.Broker {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	suffix := hex.EncodeToString(b)
	topic, group := "km0-conformance-"+suffix, "km0-conformance-"+suffix
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	topics := []string{topic, contract.RetryTopic(topic), topic + contract.DLQSuffix}
	if err := kafka.EnsureTopics(ctx, admCl, kafka.PartitionsDefault, topics...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if _, err := kadm.NewClient(admCl).DeleteTopics(ctx, topics...); err != nil {
			t.Errorf("delete topics: %v", err)
		}
	})
	pub, err := kafka.NewClient(brokers, sec...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pub.Close)
	produce := func(t testing.TB, to string, msgs []*transport.Message) {
		t.Helper()
		recs := make([]*kgo.Record, len(msgs))
		for i, m := range msgs {
			recs[i] = &kgo.Record{Topic: to, Key: m.Key, Value: m.Value}
			for _, h := range m.Headers {
				recs[i].Headers = append(recs[i].Headers, kgo.RecordHeader{Key: h.Key, Value: []byte(h.Value)})
			}
		}
		if err := pub.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	dlq := &topicReader{brokers: brokers, opts: sec, topic: topic + contract.DLQSuffix}
	t.Cleanup(dlq.close)
	return consumertest.Broker{
		Publish: func(t testing.TB, msgs ...*transport.Message) { produce(t, topic, msgs) },
		PublishRetryCopy: func(t testing.TB, m *transport.Message) {
			produce(t, contract.RetryTopic(topic), []*transport.Message{m})
		},
		Source: func(t *testing.T) transport.Source {
			src, err := kafka.NewSource(kafka.SourceConfig{Brokers: brokers, Group: group, Topics: []string{topic},
				SessionTimeout: 6 * time.Second, NoCreateTopics: true,
				KgoOpts: append([]kgo.Opt{kgo.FetchMaxWait(200 * time.Millisecond)}, sec...)})
			if err != nil {
				t.Fatal(err)
			}
			return src
		},
		DeadLetters: dlq.read,
		Pending: func(t testing.TB) int {
			t.Helper()
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			adm := kadm.NewClient(admCl)
			ends, err := adm.ListEndOffsets(ctx, topic)
			if err != nil {
				t.Fatal(err)
			}
			var n int64
			ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
			offs, err := adm.FetchOffsets(ctx, group)
			if err != nil && !errors.Is(err, kerr.GroupIDNotFound) {
				t.Fatal(err)
			}
			offs.Each(func(o kadm.OffsetResponse) {
				if o.Topic == topic && o.Err == nil && o.At > 0 {
					n -= o.At
				}
			})
			return int(n)
		},
	}
}

// topicReader reads a topic from its start and keeps what it read.
type topicReader struct {
	brokers []string
	opts    []kgo.Opt // the broker's security
	topic   string
	mu      sync.Mutex
	cl      *kgo.Client
	got     []*transport.Message
}

func (r *topicReader) read(t testing.TB, n int) []*transport.Message {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cl == nil {
		cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(r.brokers...), kgo.ConsumeTopics(r.topic),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100 * time.Millisecond)}, r.opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		r.cl = cl
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for len(r.got) < n {
		fs := r.cl.PollFetches(ctx)
		if ctx.Err() != nil {
			break
		}
		fs.EachRecord(func(rec *kgo.Record) { r.got = append(r.got, kafka.FromRecord(rec)) })
	}
	return r.got
}

func (r *topicReader) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cl != nil {
		r.cl.Close()
	}
}
