package kafka_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// A topic km0 creates on a three-broker cluster has the replication factor
// asked for, min.insync.replicas one less, and the contract's 14 days of
// retention, whatever the brokers' defaults (kfake's: 7 days).
func TestEnsureTopicSpecsCreatesWithExplicitSettings(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewWith(t, kafkaembed.Config{Extra: []kfake.Opt{kfake.NumBrokers(3), kfake.Ports(0, 0, 0)}})
	cl := kafkatest.Client(t, b)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ts := kafka.TopicSettings{ReplicationFactor: 3}
	if err := kafka.EnsureTopicSpecs(ctx, cl, nil, ts.Spec("comandes.esdeveniments", 6), ts.Spec("comandes.esdeveniments.dlq", 0)); err != nil {
		t.Fatal(err)
	}
	have, err := kafka.DescribeTopics(ctx, cl, "comandes.esdeveniments", "comandes.esdeveniments.dlq", "absent")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"comandes.esdeveniments", "comandes.esdeveniments.dlq"} {
		want := kafka.TopicSpec{Name: name, Partitions: 6, ReplicationFactor: 3, MinInsyncReplicas: 2, RetentionMs: 14 * 24 * 3600 * 1000}
		if have[name] != want {
			t.Errorf("%s: %+v, want %+v", name, have[name], want)
		}
	}
	if _, ok := have["absent"]; ok || len(have) != 2 {
		t.Errorf("described %d topics (%v), want the 2 that exist", len(have), have)
	}
	// Three brokers cannot hold four replicas: refused for good, not retried.
	err = kafka.EnsureTopicSpecs(ctx, cl, nil, kafka.TopicSettings{ReplicationFactor: 4}.Spec("massa", 1))
	if err == nil || !strings.Contains(err.Error(), "massa") || ctx.Err() != nil {
		t.Fatalf("replication factor 4 on 3 brokers: %v, want a refusal naming the topic", err)
	}
}

// An existing topic is never changed: its 1 h retention and 2 partitions
// stay, and a warning names each difference.
func TestEnsureTopicSpecsLeavesAnExistingTopicAndWarns(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t)
	cl := kafkatest.Client(t, b)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := kadm.NewClient(cl).CreateTopic(ctx, 2, 1, map[string]*string{"retention.ms": kadm.StringPtr("3600000")}, "vell"); err != nil {
		t.Fatal(err)
	}
	var logs testlog.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if err := kafka.EnsureTopicSpecs(ctx, cl, log, kafka.TopicSettings{ReplicationFactor: 1}.Spec("vell", 6)); err != nil {
		t.Fatal(err)
	}
	have, err := kafka.DescribeTopics(ctx, cl, "vell")
	if err != nil {
		t.Fatal(err)
	}
	if h := have["vell"]; h.Partitions != 2 || h.RetentionMs != 3_600_000 {
		t.Fatalf("existing topic changed: %+v, want 2 partitions and retention.ms 3600000", h)
	}
	out := logs.String()
	for _, want := range []string{"level=WARN", "topic=vell", "2 partitions, want 6", "retention.ms 3600000, want 1209600000"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
	// A topic as km0 wants it: no warning.
	var quiet testlog.Buffer
	spec := kafka.TopicSettings{ReplicationFactor: 1}.Spec("nou", 3)
	for range 2 {
		if err := kafka.EnsureTopicSpecs(ctx, cl, slog.New(slog.NewTextHandler(&quiet, nil)), spec); err != nil {
			t.Fatal(err)
		}
	}
	if strings.Contains(quiet.String(), "WARN") {
		t.Errorf("warning about a topic that matches:\n%s", quiet.String())
	}
}

func TestTopicSettingsDefaults(t *testing.T) {
	t.Parallel()
	for rf, isr := range map[int16]int{-1: 0, 0: 0, 1: 1, 2: 1, 3: 2, 5: 4} {
		if got := kafka.MinInsyncFor(rf); got != isr {
			t.Errorf("MinInsyncFor(%d) = %d, want %d", rf, got, isr)
		}
	}
	s := kafka.TopicSettings{}.Spec("t", 0)
	if s.Partitions != 6 || s.ReplicationFactor != 0 || s.MinInsyncReplicas != 0 || s.RetentionMs != 1_209_600_000 {
		t.Fatalf("zero settings: %+v", s)
	}
	if c := s.Configs(); len(c) != 1 || *c["retention.ms"] != "1209600000" {
		t.Fatalf("configs %v", c)
	}
}

// The embedded broker's seeded topics keep the contract's retention too, so
// that EnsureTopicSpecs finds nothing to warn about.
func TestEmbeddedSeededTopicsKeepFourteenDays(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, "comandes.esdeveniments")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := kafkatest.Client(t, b)
	have, err := kafka.DescribeTopics(ctx, cl, "comandes.esdeveniments")
	if err != nil || have["comandes.esdeveniments"].RetentionMs != 1_209_600_000 {
		t.Fatalf("seeded topic %+v (%v), want retention.ms 1209600000", have, err)
	}
	var logs testlog.Buffer
	if err := kafka.EnsureTopicSpecs(ctx, cl, slog.New(slog.NewTextHandler(&logs, nil)), kafka.TopicSettings{ReplicationFactor: 1}.Spec("comandes.esdeveniments", 6)); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(logs.String(), "WARN") {
		t.Errorf("warning about a seeded topic:\n%s", logs.String())
	}
}
