package doctor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/kafka"
)

// checkKafka checks the Kafka connection with its TLS and SASL settings,
// then the contract's topics: present, their partitions, replication and
// retention against the contract's.
func checkKafka(ctx context.Context, r *Report, cfg Config) {
	target := strings.Join(cfg.Brokers, ",")
	sec := cfg.KafkaSecurity
	opts, err := sec.Opts()
	if err != nil {
		r.fail("kafka connection", target, err.Error(), "fix the --kafka-tls-* / --kafka-sasl-* settings named")
		return
	}
	cl, err := kafka.NewClient(cfg.Brokers, opts...)
	if err != nil {
		r.fail("kafka connection", target, err.Error(), "fix --brokers ($KM0_KAFKA_BROKERS)")
		return
	}
	defer cl.Close()
	err = cfg.withTimeout(ctx, func(ctx context.Context) error { return kafka.Ping(ctx, cl) })
	switch {
	case errors.Is(err, kafka.ErrSecurity) && strings.Contains(err.Error(), "SASL"):
		r.fail("kafka connection", target, sec.String()+": "+err.Error(),
			"check --kafka-sasl-mechanism and --kafka-sasl-username ($KM0_KAFKA_SASL_*) and the password in $KM0_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file")
		return
	case errors.Is(err, kafka.ErrSecurity):
		r.fail("kafka connection", target, sec.String()+": "+err.Error(),
			"check --kafka-tls-ca-file, --kafka-tls-server-name and the client certificate (--kafka-tls-cert-file, --kafka-tls-key-file)")
		return
	case err != nil:
		r.fail("kafka connection", target, "no broker answers within "+cfg.Timeout.String()+": "+err.Error(),
			"check --brokers ($KM0_KAFKA_BROKERS) and that this host reaches them; a managed cluster needs --kafka-tls and SASL")
		return
	}
	if !sec.Enabled() && !allLoopback(cfg.Brokers) {
		r.warn("kafka connection", target, sec.String(), "turn on TLS and SASL (--kafka-tls, --kafka-sasl-mechanism): the events cross the network in clear, unauthenticated")
	} else {
		r.ok("kafka connection", target, sec.String())
	}
	if len(cfg.kafkaTopics) > 0 {
		checkTopics(ctx, r, cl, cfg)
	}
	switch {
	case sec.SASLMechanism == "":
	case len(cfg.rabbitTopics) > 0 || cfg.AMQPURL != "":
		// system.RequiredACLs are those of everything on Kafka.
		r.warn("kafka ACLs", target, "not checked: some events or request/reply go over RabbitMQ, and the required ACLs are derived for everything on Kafka",
			"check by hand that each service's principal holds the ACLs of what it does on Kafka")
	default:
		checkACLs(ctx, r, cl, cfg)
	}
}

// checkTopics checks each of cfg.kafkaTopics against its spec
// (system.TopicSpecs: kafka.PartitionsDefault partitions, the contract's
// retention, and on a cluster of 3 brokers or more a replication factor of
// 3 with min.insync.replicas 2). A missing topic or a shorter retention is a
// failure; another difference a warning. A topic is reported, never changed.
func checkTopics(ctx context.Context, r *Report, cl *kgo.Client, cfg Config) {
	var (
		have map[string]kafka.TopicSpec
		nb   int
	)
	err := cfg.withTimeout(ctx, func(ctx context.Context) (err error) {
		md, err := kadm.NewClient(cl).BrokerMetadata(ctx)
		if err != nil {
			return err
		}
		nb = len(md.Brokers)
		have, err = kafka.DescribeTopics(ctx, cl, cfg.kafkaTopics...)
		return err
	})
	if err != nil {
		r.fail("kafka topics", strings.Join(cfg.Brokers, ","), "the topics could not be described: "+err.Error(),
			"grant the doctor's principal DESCRIBE and DESCRIBE_CONFIGS on the topics")
		return
	}
	ts := kafka.TopicSettings{ReplicationFactor: kafka.AutoReplicationFactor(nb)}
	specs := map[string]kafka.TopicSpec{}
	for _, sp := range system.TopicSpecs(cfg.System.Topics, ts) {
		specs[sp.Name] = sp
	}
	for _, t := range cfg.kafkaTopics {
		want, ok := specs[t]
		if !ok {
			want = ts.Spec(t, kafka.PartitionsDefault)
		}
		got, ok := have[t]
		if !ok {
			r.fail("kafka topic", t, "missing",
				fmt.Sprintf("create it: km0 up and km0 serve create the contract's topics at start, or kafka-topics.sh --create --topic %s --partitions %d --replication-factor %d --config retention.ms=%d",
					t, want.Partitions, want.ReplicationFactor, want.RetentionMs))
			continue
		}
		seen := fmt.Sprintf("%d partitions, %d replicas, retention %v", got.Partitions, got.ReplicationFactor, time.Duration(got.RetentionMs)*time.Millisecond)
		if got.RetentionMs < 0 {
			seen = fmt.Sprintf("%d partitions, %d replicas, retention unlimited", got.Partitions, got.ReplicationFactor)
		}
		diffs := want.Differences(got)
		switch {
		case got.RetentionMs >= 0 && got.RetentionMs < want.RetentionMs:
			r.fail("kafka topic", t, seen, strings.Join(diffs, "; ")+fmt.Sprintf(": the contract keeps events 14 days; kafka-configs.sh --alter --entity-type topics --entity-name %s --add-config retention.ms=%d", t, want.RetentionMs))
		case len(diffs) > 0:
			r.warn("kafka topic", t, seen, strings.Join(diffs, "; ")+" (km0 never changes an existing topic: alter it, or recreate it while empty)")
		default:
			r.ok("kafka topic", t, seen)
		}
	}
}

// allLoopback reports whether every broker is on this machine.
func allLoopback(brokers []string) bool {
	for _, b := range brokers {
		host, _, err := net.SplitHostPort(b)
		if err != nil {
			host = b
		}
		if !loopback(host) {
			return false
		}
	}
	return true
}
