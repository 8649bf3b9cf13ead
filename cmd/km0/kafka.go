package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

func init() {
	register(&command{name: "kafka", summary: "run an embedded Kafka broker (kfake) that external clients can use", run: runKafka})
}

// DomainTopics are the topics of CONTRACT.md, with their retry and DLQ topics.
func domainTopics() []string {
	var out []string
	for _, s := range []string{"comandes", "inventari", "pagaments", "repartiment"} {
		t := s + ".esdeveniments"
		out = append(out, t, contract.RetryTopic(t), contract.DLQName(t))
	}
	return out
}

func runKafka(ctx context.Context, args []string) error {
	fs := cli.NewFlags("kafka", "run an embedded Kafka broker (kfake) speaking the real protocol")
	addr := fs.String("kafka-addr", "127.0.0.1:9092", "listen address of the broker, host:port")
	advertise := fs.String("advertise-host", "", "host given to clients in the metadata (default the --kafka-addr host); set it with --kafka-addr 0.0.0.0:PORT")
	dataDir := fs.String("data-dir", "", "persist the broker's data here (survives restarts)")
	partitions := fs.Int("partitions", kafka.PartitionsDefault, "partitions of each created topic")
	minSession := fs.Duration("group-min-session-timeout", 6*time.Second, "least group session timeout a consumer may ask for (group.min.session.timeout.ms)")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *partitions < 1 {
		return fmt.Errorf("--partitions %d must be at least 1", *partitions)
	}
	if *minSession <= 0 {
		return fmt.Errorf("--group-min-session-timeout %v must be positive", *minSession)
	}
	b, err := kafkaembed.Start(kafkaembed.Config{Addr: *addr, AdvertiseHost: *advertise, DataDir: *dataDir, Partitions: *partitions, Topics: domainTopics(),
		GroupMinSessionTimeout: *minSession})
	if err != nil {
		return err
	}
	defer b.Close()
	fmt.Printf("km0 kafka: listening on %s (new topics get %d partitions; data dir %q); topics: %s\n",
		strings.Join(b.Addrs(), ","), *partitions, *dataDir, strings.Join(domainTopics(), " "))
	<-ctx.Done()
	fmt.Println("km0 kafka: stopping")
	return nil
}
