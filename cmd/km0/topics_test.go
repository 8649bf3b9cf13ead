package main

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// Without --kafka-replication-factor, km0 relay on a one-node broker (km0
// kafka, a developer's cluster) creates its topic with one replica and warns
// that a production cluster needs 3; asked for 3 explicitly, the broker
// refuses and the relay exits at once naming the cause instead of creating
// an unreplicated topic.
func TestRelayDefaultReplicationFactor(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t)
	s := pgtest.NewMigratedSchema(t)
	env := []string{replicationFactorEnv + "=", "KM0_DATABASE_URL=" + pgtest.URL()}
	p := startKm0(t, env, "relay", "--schema", s.Name, "--brokers", strings.Join(b.Addrs(), ","), "--topic", "comandes.esdeveniments", "--origin", "comandes", "--poll", "20ms")
	waitTopic(t, kafkatest.Client(t, b), kafka.TopicSpec{Name: "comandes.esdeveniments", Partitions: 6, ReplicationFactor: 1, MinInsyncReplicas: 1, RetentionMs: 1_209_600_000})
	testkit.Eventually(t, time.Minute, "the small-cluster warning", func() bool {
		return strings.Contains(p.log(), "fewer brokers than a production replication factor needs")
	})

	_, errOut, err := runKm0(t, env, "relay", "--schema", s.Name, "--brokers", strings.Join(b.Addrs(), ","),
		"--topic", "comandes.altres", "--origin", "comandes", "--kafka-replication-factor", "3")
	if err == nil || !strings.Contains(errOut, "INVALID_REPLICATION_FACTOR") || !strings.Contains(errOut, "comandes.altres") {
		t.Fatalf("km0 relay with replication factor 3 on one node: %v, want an exit naming INVALID_REPLICATION_FACTOR and the topic:\n%s", err, errOut)
	}
}

// On a three-broker cluster the relay's topic gets, by default,
// replication factor 3, min.insync.replicas 2 and the contract's 14 days of
// retention. The relay is a process, so that its environment has no
// replication factor (the default) while other tests run.
func TestRelayCreatesTheTopicForACluster(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewWith(t, kafkaembed.Config{Extra: []kfake.Opt{kfake.NumBrokers(3), kfake.Ports(0, 0, 0)}})
	s := pgtest.NewMigratedSchema(t)
	p := startKm0(t, []string{replicationFactorEnv + "=", "KM0_DATABASE_URL=" + pgtest.URL()}, "relay", "--schema", s.Name,
		"--brokers", strings.Join(b.Addrs(), ","), "--topic", "comandes.esdeveniments", "--origin", "comandes", "--poll", "20ms")
	waitTopic(t, kafkatest.Client(t, b), kafka.TopicSpec{Name: "comandes.esdeveniments", Partitions: 6, ReplicationFactor: 3, MinInsyncReplicas: 2, RetentionMs: 1_209_600_000})
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.exited:
	case <-time.After(testkit.StopTimeout):
		t.Fatalf("km0 relay still running %v after SIGTERM\n%s", testkit.StopTimeout, p.log())
	}
	if p.err != nil {
		t.Fatalf("km0 relay: %v\n%s", p.err, p.log())
	}
}

// waitTopic waits until the cluster describes topic want.Name as want.
func waitTopic(t *testing.T, cl *kgo.Client, want kafka.TopicSpec) {
	t.Helper()
	var have kafka.TopicSpec
	testkit.Eventuallyf(t, 20*time.Second, fmt.Sprintf("topic %+v", want), func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		got, err := kafka.DescribeTopics(ctx, cl, want.Name)
		cancel()
		if err == nil {
			have = got[want.Name]
		}
		return have == want, fmt.Sprintf("have %+v", have)
	})
}

// Not parallel: t.Setenv, for the environment the flag set
// ($KM0_KAFKA_REPLICATION_FACTOR) reads in this process.
func TestKafkaReplicationFactorFlag(t *testing.T) {
	for _, c := range []struct {
		env, arg string
		embedded bool
		want     int16
		bad      bool
	}{
		{want: kafka.ReplicationFactorAuto}, {embedded: true, want: 1}, {arg: "2", want: 2}, {arg: "5", embedded: true, want: 5},
		{env: "1", want: 1}, {env: "1", arg: "3", want: 3}, {arg: "-1", bad: true}, {env: "tres", bad: true},
	} {
		t.Setenv(replicationFactorEnv, c.env)
		fs := cli.NewFlags("x", "test")
		k := cli.NewKafkaTopicFlags(fs)
		var args []string
		if c.arg != "" {
			args = []string{"--kafka-replication-factor", c.arg}
		}
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		ts, err := k.Settings(c.embedded)
		if (err != nil) != c.bad || ts.ReplicationFactor != c.want {
			t.Errorf("%+v: %+v (%v)", c, ts, err)
		}
	}
}
