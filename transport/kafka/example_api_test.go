package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sort"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/transport/kafka"
)

// The topic km0 asks for in production: replication factor
// ReplicationFactorDefault, min.insync.replicas one less (MinInsyncFor), so
// that acks=all survives one broker down; Configs are what CreateTopics
// sends.
func ExampleTopicSettings_Spec() {
	s := kafka.TopicSettings{ReplicationFactor: kafka.ReplicationFactorDefault}
	spec := s.Spec("comandes.esdeveniments", 0)
	fmt.Println(spec.Name, spec.Partitions, spec.ReplicationFactor, spec.MinInsyncReplicas == kafka.MinInsyncFor(kafka.ReplicationFactorDefault))
	cfg := spec.Configs()
	keys := make([]string, 0, len(cfg))
	for k := range cfg {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Println(k, *cfg[k])
	}
	// Output:
	// comandes.esdeveniments 6 3 true
	// min.insync.replicas 2
	// retention.ms 1209600000
}

// The defaults of a Source and of its group membership.
func ExampleSourceConfig_defaults() {
	fmt.Println("CommitInterval", kafka.CommitIntervalDefault)
	fmt.Println("MaxHeld", kafka.MaxHeldDefault)
	fmt.Println("heartbeat at most every", kafka.HeartbeatIntervalMax)
	// Output:
	// CommitInterval 20ms
	// MaxHeld 10000
	// heartbeat at most every 1s
}

// The SASL mechanisms besides SCRAM-SHA-512 (see ExampleSecurity).
func ExampleSecurity_mechanisms() {
	for _, sec := range []kafka.Security{
		{TLS: true, SASLMechanism: kafka.SASLScramSHA256, SASLUsername: "km0-relay", SASLPassword: "example"},
		{TLS: true, SASLMechanism: kafka.SASLOAuthBearer, SASLUsername: "km0-relay", SASLPassword: "a-token"},
		{TLS: true, SASLMechanism: kafka.SASLAWSMSKIAM, SASLUsername: "AKIAEXAMPLE", SASLPassword: "example"},
	} {
		if _, err := sec.Opts(); err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println(sec)
	}
	// Output:
	// SASL_SSL SCRAM-SHA-256 user km0-relay
	// kafka: security: SASL OAUTHBEARER needs a token file
	// kafka: security: SASL AWS_MSK_IAM needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment
}

// Republish puts a dead letter back on its original topic with a client
// built with ProducerOpts (acks=all, idempotent, km0's partitioner), so its
// key lands where the original did. A produce error for which
// IsRejectedForGood is true will never succeed (the record itself is the
// problem: too large, invalid); any other may on a later try.
func ExampleRepublish() {
	cl, err := kafka.NewClient([]string{"127.0.0.1:9092"}, kafka.ProducerOpts()...)
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	rec := &kgo.Record{Topic: "comandes.esdeveniments.dlq", Key: []byte("c-1"), Value: []byte(`{}`)}
	switch err := kafka.Republish(context.Background(), cl, rec); {
	case errors.Is(err, kafka.ErrNoOriginalTopic):
		log.Print("not a dead letter of a known topic: ", err)
	case kafka.IsRejectedForGood(err):
		log.Print("the broker will never take it: ", err)
	case err != nil:
		log.Print("try again later: ", err)
	}
}
