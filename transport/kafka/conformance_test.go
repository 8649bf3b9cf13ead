package kafka_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/transporttest"
)

// TestPublisherConformance runs the publisher suite against an in-process
// kfake broker, or against the cluster KM0_TEST_KAFKA_BROKERS names
// (comma-separated host:port list).
func TestPublisherConformance(t *testing.T) {
	t.Parallel()
	brokers := kafka.SplitBrokers(os.Getenv("KM0_TEST_KAFKA_BROKERS"))
	if len(brokers) == 0 {
		// Without auto-creation, like a production cluster: a topic that
		// does not exist is unroutable.
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.DefaultNumPartitions(kafka.PartitionsDefault))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		brokers = c.ListenAddrs()
	}
	transporttest.Run(t, kafkaHarness(t, brokers, kafka.Security{}))
}

// TestPublisherConformanceSecured runs the publisher suite against kfake
// with SASL SCRAM-SHA-512 over TLS (a test CA) and with SASL PLAIN: every
// client of the suite (publisher, admin, readers) goes through
// kafka.Security's options.
func TestPublisherConformanceSecured(t *testing.T) {
	t.Parallel()
	for _, cfg := range []kafkatest.SecureConfig{
		{Mechanism: kafka.SASLScramSHA512, TLS: true},
		{Mechanism: kafka.SASLPlain},
	} {
		t.Run(cfg.Mechanism, func(t *testing.T) {
			t.Parallel()
			b := kafkatest.NewSecure(t, cfg)
			transporttest.Run(t, kafkaHarness(t, b.Addrs(), b.Security))
		})
	}
}

func kafkaHarness(t *testing.T, brokers []string, sec kafka.Security) transporttest.Harness {
	secOpts, err := sec.Opts()
	if err != nil {
		t.Fatal(err)
	}
	admCl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...)}, secOpts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admCl.Close)
	adm := kadm.NewClient(admCl)
	f := transporttest.Features{HeaderOrder: true, Unroutable: true}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	cfgs, err := adm.DescribeBrokerConfigs(ctx)
	if err != nil {
		t.Fatalf("Kafka at %v did not answer: %v", brokers, err)
	}
	for _, rc := range cfgs {
		for _, c := range rc.Configs {
			if c.Key == "auto.create.topics.enable" && c.Value != nil && *c.Value == "true" {
				f.Unroutable, f.NoUnroutable = false, "the cluster creates topics on first use (auto.create.topics.enable=true)"
			}
		}
	}
	return transporttest.Harness{Features: f, New: func(t *testing.T, gate *transporttest.Gate) transporttest.Target {
		// UnknownTopicRetries(1): a topic that does not exist fails its
		// records after one metadata refresh instead of four; a short
		// MetadataMinAge finds the broker again soon after an outage.
		gated := sec
		gated.Dialer = gate.DialContext
		gatedOpts, err := gated.Opts()
		if err != nil {
			t.Fatal(err)
		}
		cl, err := kafka.NewClient(brokers, append(gatedOpts, kgo.UnknownTopicRetries(1),
			kgo.MetadataMinAge(250*time.Millisecond))...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		r := &kafkaReader{brokers: brokers, opts: secOpts, cls: map[string]*kgo.Client{}}
		t.Cleanup(r.close)
		create := func(topic string) {
			t.Helper()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			resp, err := adm.CreateTopics(ctx, kafka.PartitionsDefault, -1,
				map[string]*string{"max.message.bytes": kadm.StringPtr(strconv.Itoa(transporttest.MaxBytes))}, topic)
			if err == nil {
				err = resp.Error()
			}
			if err != nil {
				t.Fatalf("create topic %s: %v", topic, err)
			}
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
				defer cancel()
				if _, err := adm.DeleteTopics(ctx, topic); err != nil {
					t.Errorf("delete topic %s: %v", topic, err)
				}
			})
		}
		b := make([]byte, 5)
		_, _ = rand.Read(b)
		topic := "km0-conformance-" + hex.EncodeToString(b)
		create(topic)
		return transporttest.Target{Publisher: kafka.NewPublisher(cl), Topic: topic, Create: create, Read: r.read}
	}}
}

// kafkaReader reads each topic from its start with one client per topic, so
// that a Read returns only what the previous Read of the topic did not.
type kafkaReader struct {
	brokers []string
	opts    []kgo.Opt // the broker's security
	mu      sync.Mutex
	cls     map[string]*kgo.Client
}

func (r *kafkaReader) read(topic string, n int, timeout time.Duration) []*transport.Message {
	r.mu.Lock()
	cl, ok := r.cls[topic]
	if !ok {
		var err error
		cl, err = kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(r.brokers...), kgo.ConsumeTopics(topic),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}, r.opts...)...)
		if err != nil {
			r.mu.Unlock()
			panic(err)
		}
		r.cls[topic] = cl
	}
	r.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out []*transport.Message
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			break
		}
		fs.EachRecord(func(rec *kgo.Record) { out = append(out, kafka.FromRecord(rec)) })
	}
	return out
}

func (r *kafkaReader) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, cl := range r.cls {
		cl.Close()
	}
}
