package lag_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/transport/kafka/kafkalag"
)

// The metrics a Sampler's collector exports, for dashboards and alerts
// (docs/console.md has the Grafana dashboard over them).
func Example_metrics() {
	for _, name := range []string{
		lag.MetricGroupLag, lag.MetricGroupOldest,
		lag.MetricOutboxPending, lag.MetricOutboxOldest, lag.MetricOutboxWALLag, lag.MetricOutboxWALRetained,
		lag.MetricQueueReady, lag.MetricQueueUnacked, lag.MetricQueueConsumers,
		lag.MetricSampleTime, lag.MetricSampleErrors,
	} {
		fmt.Println(name)
	}
	// Output:
	// km0_consumer_group_lag
	// km0_consumer_group_oldest_unprocessed_seconds
	// km0_outbox_pending_rows
	// km0_outbox_oldest_pending_seconds
	// km0_outbox_wal_lag_bytes
	// km0_outbox_wal_retained_bytes
	// km0_rabbitmq_queue_messages_ready
	// km0_rabbitmq_queue_messages_unacked
	// km0_rabbitmq_queue_consumers
	// km0_lag_sample_timestamp_seconds
	// km0_lag_sample_errors
}

// A Kafka probe without the groups to measure is refused: the system's
// groups are listed (or AllGroups asked for).
func ExampleNewMeasurer_noGroups() {
	probe, err := kafkalag.New(kafkalag.Config{Brokers: []string{"127.0.0.1:9092"}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer probe.Close()
	_, err = lag.NewMeasurer(lag.Config{Kafka: probe})
	fmt.Println(errors.Is(err, lag.ErrNoGroups))
	// Output:
	// true
}

// A Watch alerts on a group over its Rule. Here a snapshot is built by
// hand; a Sampler (SamplerConfig.Watch) evaluates each of its own, every
// Interval (IntervalDefault), and keeps Window (WindowDefault) of history.
func ExampleWatch() {
	alerter, err := dlq.NewAlerter(dlq.AlerterConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registerer: prometheus.NewRegistry()})
	if err != nil {
		fmt.Println(err)
		return
	}
	w := lag.NewWatch(lag.Rule{MaxLag: 100}, alerter)
	w.Evaluate(context.Background(), &lag.Snapshot{At: time.Now(), Groups: []lag.GroupLag{
		{Group: "inventari.descompte_estoc", Total: 250},
		{Group: "repartiment.assignacio", Total: 3},
	}})
	fmt.Println(w.Firing())
	fmt.Println(lag.IntervalDefault, lag.WindowDefault)
	// Output:
	// [grup inventari.descompte_estoc]
	// 15s 1h0m0s
}

// A Sampler measures on demand too: Sample takes one snapshot now, adds it
// to the history and evaluates the Watch. The Measurer bounds the read of a
// WAL outbox's oldest message by OldestTimeout (OldestTimeoutDefault).
func ExampleSampler_Sample() {
	m, err := lag.NewMeasurer(lag.Config{OldestTimeout: lag.OldestTimeoutDefault /* Outboxes, Kafka, Groups ... */})
	if err != nil {
		log.Fatal(err)
	}
	s := lag.NewSampler(lag.SamplerConfig{Measurer: m})
	snap, err := s.Sample(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	for _, g := range snap.Groups {
		fmt.Println(g.Group, g.Total)
	}
}
