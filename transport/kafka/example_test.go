package kafka_test

import (
	"context"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// A publisher on the embedded broker (kfake, the real Kafka protocol in
// process): Publish returns nil only once the broker confirmed every
// message (acks=all, idempotent producer), and the messages of one key
// (agregat_id) land on one partition, in the order published. A consumer
// reads them back here with a plain kgo client; a km0 consumer would use
// NewSource.
func ExamplePublisher() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const topic = "comandes.esdeveniments"
	broker, err := kafkaembed.Start(kafkaembed.Config{Partitions: 3, Topics: []string{topic}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer broker.Close()
	cl, err := kafka.NewClient(broker.Addrs())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()
	var msgs []*transport.Message
	for i, key := range []string{"P-2026-000123", "P-2026-000124", "P-2026-000123"} {
		m := &transport.Message{Topic: topic, Key: []byte(key), Value: fmt.Appendf(nil, `{"n":%d}`, i+1)}
		m.SetHeader(contract.HeaderType, "comanda.creada")
		msgs = append(msgs, m)
	}
	if err := kafka.NewPublisher(cl).Publish(ctx, msgs); err != nil { // nil: every message confirmed
		fmt.Println(err)
		return
	}

	rd, err := kgo.NewClient(kgo.SeedBrokers(broker.Addrs()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rd.Close()
	partition := map[string]int32{}
	var got []string
	for len(got) < len(msgs) && ctx.Err() == nil {
		rd.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
			m := kafka.FromRecord(r)
			tipus, _ := m.Header(contract.HeaderType)
			if p, seen := partition[string(m.Key)]; seen && p != r.Partition {
				fmt.Println("one key on two partitions:", string(m.Key))
			}
			partition[string(m.Key)] = r.Partition
			got = append(got, fmt.Sprintf("%s %s %s", m.Key, tipus, m.Value))
		})
	}
	// Across partitions the order is not defined: print per key.
	for _, key := range []string{"P-2026-000123", "P-2026-000124"} {
		for _, g := range got {
			if g[:len(key)] == key {
				fmt.Println(g)
			}
		}
	}
	// Output:
	// P-2026-000123 comanda.creada {"n":1}
	// P-2026-000123 comanda.creada {"n":3}
	// P-2026-000124 comanda.creada {"n":2}
}
