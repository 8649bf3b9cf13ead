package lag_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/lag"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
	"github.com/km0/km0/transport/kafka/kafkalag"
)

// The lag of a consumer group: five events on a one-partition topic of the
// embedded broker, the group inventari has committed the first two, so it
// is three records behind. The same Measurer reports outboxes (rows not yet
// published) and RabbitMQ queues when configured with them.
func ExampleMeasurer() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const topic = "comandes.esdeveniments"
	broker, err := kafkaembed.Start(kafkaembed.Config{Partitions: 1, Topics: []string{topic}})
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
	for i := range 5 {
		msgs = append(msgs, &transport.Message{Topic: topic, Key: []byte("P-2026-000123"), Value: fmt.Appendf(nil, `{"n":%d}`, i)})
	}
	if err := kafka.NewPublisher(cl).Publish(ctx, msgs); err != nil {
		fmt.Println(err)
		return
	}
	var committed kadm.Offsets
	committed.Add(kadm.Offset{Topic: topic, Partition: 0, At: 2, LeaderEpoch: -1})
	if _, err := kadm.NewClient(cl).CommitOffsets(ctx, "inventari", committed); err != nil {
		fmt.Println(err)
		return
	}

	probe, err := kafkalag.New(kafkalag.Config{Brokers: broker.Addrs()})
	if err != nil {
		fmt.Println(err)
		return
	}
	m, err := lag.NewMeasurer(lag.Config{Kafka: probe, Groups: []string{"inventari"},
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Close()
	snap, err := m.Measure(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, g := range snap.Groups {
		fmt.Printf("group %s: %d behind\n", g.Group, g.Total)
		for _, p := range g.Partitions {
			fmt.Printf("  %s/%d: committed %d of %d\n", p.Topic, p.Partition, p.Committed, p.End)
		}
	}
	fmt.Println("total", snap.Total(), "errors", len(snap.Errors))
	// Output:
	// group inventari: 3 behind
	//   comandes.esdeveniments/0: committed 2 of 5
	// total 3 errors 0
}
