package kafka

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Topic settings km0 creates its topics with (CONTRACT.md: 14 days of
// retention, the window inside which a redelivery or a replay can arrive).
const (
	// RetentionDefault is the contract's retention of every km0 topic.
	RetentionDefault = 14 * 24 * time.Hour
	// ReplicationFactorDefault is the replication factor on a cluster.
	ReplicationFactorDefault int16 = 3
	// ReplicationFactorEmbedded is the replication factor on the embedded
	// broker (one node).
	ReplicationFactorEmbedded int16 = 1
	// ReplicationFactorAuto asks EnsureTopicSpecs for
	// AutoReplicationFactor(the number of brokers the cluster reports):
	// ReplicationFactorDefault on a cluster of three brokers or more, every
	// broker on a smaller one (with a warning that it is not enough for
	// production). The km0 commands' default.
	ReplicationFactorAuto int16 = -2
)

// AutoReplicationFactor is the replication factor ReplicationFactorAuto
// resolves to on a cluster of brokers brokers: ReplicationFactorDefault,
// or brokers when there are fewer (at least 1).
func AutoReplicationFactor(brokers int) int16 {
	return int16(max(1, min(int(ReplicationFactorDefault), brokers)))
}

// TopicSettings are the settings EnsureTopics gives a topic it creates.
// The zero value means the broker's default.replication.factor, no
// min.insync.replicas of the topic's own and RetentionDefault.
type TopicSettings struct {
	// ReplicationFactor of a created topic. Default 0: the broker's
	// default.replication.factor (-1 on the wire). The km0 commands set it
	// explicitly (--kafka-replication-factor: 3, 1 on the embedded broker).
	ReplicationFactor int16
	// MinInsyncReplicas of a created topic. Default 0: MinInsyncFor
	// (ReplicationFactor), nothing when the replication factor is the
	// broker's.
	MinInsyncReplicas int
	// Retention of a created topic. Default RetentionDefault.
	Retention time.Duration
}

// MinInsyncFor is the min.insync.replicas km0 asks for with replication
// factor rf: one less than rf (2 with 3, so that acks=all survives one broker
// down), at least 1; 0 (not set) for rf <= 0.
func MinInsyncFor(rf int16) int {
	if rf <= 0 {
		return 0
	}
	return max(int(rf)-1, 1)
}

// TopicSpec is one topic as km0 wants it: what EnsureTopics creates and what
// `km0 doctor` compares a cluster's topics with. ReplicationFactor <= 0 and
// MinInsyncReplicas == 0 mean "the broker's default" and are not compared.
type TopicSpec struct {
	Name              string
	Partitions        int32
	ReplicationFactor int16
	MinInsyncReplicas int
	RetentionMs       int64
}

// Spec returns the spec of topic name with partitions partitions under s
// (defaults applied).
func (s TopicSettings) Spec(name string, partitions int32) TopicSpec {
	if partitions <= 0 {
		partitions = PartitionsDefault
	}
	ret := s.Retention
	if ret <= 0 {
		ret = RetentionDefault
	}
	isr := s.MinInsyncReplicas
	if isr == 0 {
		isr = MinInsyncFor(s.ReplicationFactor)
	}
	return TopicSpec{Name: name, Partitions: partitions, ReplicationFactor: s.ReplicationFactor, MinInsyncReplicas: isr, RetentionMs: ret.Milliseconds()}
}

// Configs are the topic configs of s sent with CreateTopics:
// retention.ms and, when set, min.insync.replicas.
func (s TopicSpec) Configs() map[string]*string {
	c := map[string]*string{"retention.ms": kadm.StringPtr(strconv.FormatInt(s.RetentionMs, 10))}
	if s.MinInsyncReplicas > 0 {
		c["min.insync.replicas"] = kadm.StringPtr(strconv.Itoa(s.MinInsyncReplicas))
	}
	return c
}

// Differences lists, one English line each, where have (a topic as the
// cluster describes it) falls short of s: fewer partitions, another
// replication factor, min.insync.replicas or retention.ms. Settings of s at
// the broker's default are not compared. Nil when have matches.
func (s TopicSpec) Differences(have TopicSpec) []string {
	var out []string
	if have.Partitions < s.Partitions {
		out = append(out, fmt.Sprintf("%s: %d partitions, want %d", s.Name, have.Partitions, s.Partitions))
	}
	if s.ReplicationFactor > 0 && have.ReplicationFactor != s.ReplicationFactor {
		out = append(out, fmt.Sprintf("%s: replication factor %d, want %d", s.Name, have.ReplicationFactor, s.ReplicationFactor))
	}
	if s.MinInsyncReplicas > 0 && have.MinInsyncReplicas != s.MinInsyncReplicas {
		out = append(out, fmt.Sprintf("%s: min.insync.replicas %d, want %d", s.Name, have.MinInsyncReplicas, s.MinInsyncReplicas))
	}
	if s.RetentionMs != 0 && have.RetentionMs != s.RetentionMs {
		out = append(out, fmt.Sprintf("%s: retention.ms %d, want %d (%s)", s.Name, have.RetentionMs, s.RetentionMs, time.Duration(s.RetentionMs)*time.Millisecond))
	}
	return out
}

// DescribeTopics returns the existing topics among names as TopicSpecs read
// from the cluster (partitions, replication factor of partition 0,
// min.insync.replicas and retention.ms as the topic's effective configs). A
// topic that does not exist is absent from the map; an error is returned
// only when the cluster cannot be asked (unreachable, not authorised to
// describe).
func DescribeTopics(ctx context.Context, cl *kgo.Client, names ...string) (map[string]TopicSpec, error) {
	adm := kadm.NewClient(cl)
	td, err := adm.ListTopics(ctx, names...)
	if err != nil {
		return nil, fmt.Errorf("kafka: describe topics: %w", err)
	}
	out := map[string]TopicSpec{}
	var exist []string
	for _, t := range td.Sorted() {
		if t.Err != nil {
			continue // unknown topic, or not authorised: absent
		}
		s := TopicSpec{Name: t.Topic, Partitions: int32(len(t.Partitions))}
		if p, ok := t.Partitions[0]; ok {
			s.ReplicationFactor = int16(len(p.Replicas))
		}
		out[t.Topic] = s
		exist = append(exist, t.Topic)
	}
	if len(exist) == 0 {
		return out, nil
	}
	rcs, err := adm.DescribeTopicConfigs(ctx, exist...)
	if err != nil {
		return nil, fmt.Errorf("kafka: describe topic configs: %w", err)
	}
	for _, rc := range rcs {
		if rc.Err != nil {
			return nil, fmt.Errorf("kafka: describe configs of %s: %w", rc.Name, rc.Err)
		}
		s := out[rc.Name]
		for _, c := range rc.Configs {
			if c.Value == nil {
				continue
			}
			switch c.Key {
			case "retention.ms":
				s.RetentionMs, _ = strconv.ParseInt(*c.Value, 10, 64)
			case "min.insync.replicas":
				s.MinInsyncReplicas, _ = strconv.Atoi(*c.Value)
			}
		}
		out[rc.Name] = s
	}
	return out, nil
}
