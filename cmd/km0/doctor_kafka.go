package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/km0/km0/transport/kafka"
)

// topicRetentionMin is the contract's retention of every topic (CONTRACT.md:
// 14 days): the consumers' idempotency keys are kept as long.
const topicRetentionMin = 14 * 24 * time.Hour

// checkKafka checks the Kafka connection with its TLS and SASL settings,
// then the contract's topics: present, their partitions, replication and
// retention against the contract's.
func checkKafka(ctx context.Context, r *report, cfg doctorConfig) {
	target := strings.Join(cfg.brokers, ",")
	sec := cfg.kafkaSec.security(logger())
	opts, err := sec.Opts()
	if err != nil {
		r.fail("kafka connection", target, err.Error(), "fix the --kafka-tls-* / --kafka-sasl-* settings named")
		return
	}
	cl, err := kafka.NewClient(cfg.brokers, opts...)
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
		r.fail("kafka connection", target, "no broker answers within "+cfg.timeout.String()+": "+err.Error(),
			"check --brokers ($KM0_KAFKA_BROKERS) and that this host reaches them; a managed cluster needs --kafka-tls and SASL")
		return
	}
	if !sec.Enabled() && !allLoopback(cfg.brokers) {
		r.warn("kafka connection", target, sec.String(), "turn on TLS and SASL (--kafka-tls, --kafka-sasl-mechanism): the events cross the network in clear, unauthenticated")
	} else {
		r.ok("kafka connection", target, sec.String())
	}
	checkTopics(ctx, r, kadm.NewClient(cl), cfg)
}

// checkTopics checks each of cfg.kafkaTopics: it exists, has
// kafka.PartitionsDefault partitions, 3 replicas on a cluster of 3 brokers or
// more, and a retention of at least topicRetentionMin. A topic that differs
// is reported, never changed.
func checkTopics(ctx context.Context, r *report, adm *kadm.Client, cfg doctorConfig) {
	var (
		details kadm.TopicDetails
		configs kadm.ResourceConfigs
		nb      int
	)
	err := cfg.withTimeout(ctx, func(ctx context.Context) (err error) {
		md, err := adm.Metadata(ctx, cfg.kafkaTopics...)
		if err != nil {
			return err
		}
		details, nb = md.Topics, len(md.Brokers)
		configs, err = adm.DescribeTopicConfigs(ctx, cfg.kafkaTopics...)
		var se *kadm.ShardErrors
		if errors.As(err, &se) || errors.Is(err, kerr.UnknownTopicOrPartition) {
			err = nil // a missing topic, reported below
		}
		return err
	})
	if err != nil {
		r.fail("kafka topics", strings.Join(cfg.brokers, ","), "the topics could not be described: "+err.Error(),
			"grant the doctor's principal DESCRIBE and DESCRIBE_CONFIGS on the topics")
		return
	}
	retention := map[string]string{}
	for _, rc := range configs {
		for _, c := range rc.Configs {
			if c.Key == "retention.ms" && c.Value != nil {
				retention[rc.Name] = *c.Value
			}
		}
	}
	wantRF := 1
	if nb >= 3 {
		wantRF = 3
	}
	for _, t := range cfg.kafkaTopics {
		d, ok := details[t]
		if !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition) {
			r.fail("kafka topic", t, "missing",
				fmt.Sprintf("create it: km0 up and km0 serve create the contract's topics at start, or kafka-topics.sh --create --topic %s --partitions %d --replication-factor %d --config retention.ms=%d",
					t, kafka.PartitionsDefault, wantRF, topicRetentionMin.Milliseconds()))
			continue
		}
		if d.Err != nil {
			r.fail("kafka topic", t, d.Err.Error(), "grant the doctor's principal DESCRIBE on the topic")
			continue
		}
		rf := 0
		for _, p := range d.Partitions {
			rf = max(rf, len(p.Replicas))
		}
		seen := fmt.Sprintf("%d partitions, %d replicas", len(d.Partitions), rf)
		var warns, fails []string
		if len(d.Partitions) != kafka.PartitionsDefault {
			warns = append(warns, fmt.Sprintf("the contract has %d partitions (more spread the load; the key order holds within each)", kafka.PartitionsDefault))
		}
		if rf < wantRF {
			warns = append(warns, fmt.Sprintf("replication factor %d on a cluster of %d brokers: recreate with %d replicas or reassign the partitions", rf, nb, wantRF))
		}
		if v, ok := retention[t]; ok {
			ms, err := strconv.ParseInt(v, 10, 64)
			switch {
			case err != nil:
			case ms < 0:
				seen += ", retention unlimited"
			default:
				seen += ", retention " + (time.Duration(ms) * time.Millisecond).String()
				if time.Duration(ms)*time.Millisecond < topicRetentionMin {
					fails = append(fails, fmt.Sprintf("the contract keeps events 14 days: kafka-configs.sh --alter --entity-type topics --entity-name %s --add-config retention.ms=%d", t, topicRetentionMin.Milliseconds()))
				}
			}
		}
		switch {
		case len(fails) > 0:
			r.fail("kafka topic", t, seen, strings.Join(append(fails, warns...), "; "))
		case len(warns) > 0:
			r.warn("kafka topic", t, seen, strings.Join(warns, "; "))
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
