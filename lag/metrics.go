package lag

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric names of Collector.
const (
	// MetricGroupLag is a consumer group's lag per topic and partition:
	// records after its committed offset.
	MetricGroupLag = "km0_consumer_group_lag"
	// MetricGroupOldest is the age of the first record a group has not
	// processed (its committed offset), per topic and partition.
	MetricGroupOldest = "km0_consumer_group_oldest_unprocessed_seconds"
	// MetricOutboxPending and MetricOutboxOldest are an outbox's pending rows
	// and the age of the oldest, as km0_relay_pending_rows and
	// km0_relay_oldest_pending_seconds, measured by the lag exporter (labelled
	// by outbox name) for outboxes whose relay exports nothing.
	MetricOutboxPending = "km0_outbox_pending_rows"
	MetricOutboxOldest  = "km0_outbox_oldest_pending_seconds"
	// MetricOutboxWALLag and MetricOutboxWALRetained are a WAL-mode outbox's
	// slot: the WAL written and not confirmed by its relay, and the WAL the
	// server retains for it (the relay's km0_relay_cdc_slot_lag_bytes and
	// km0_relay_cdc_slot_retained_wal_bytes, by outbox name). A WAL-mode
	// outbox has no pending rows; its oldest age is exported only when known.
	MetricOutboxWALLag      = "km0_outbox_wal_lag_bytes"
	MetricOutboxWALRetained = "km0_outbox_wal_retained_bytes"
	// MetricQueueReady, MetricQueueUnacked and MetricQueueConsumers describe
	// a RabbitMQ queue; unacked only with the management API.
	MetricQueueReady     = "km0_rabbitmq_queue_messages_ready"
	MetricQueueUnacked   = "km0_rabbitmq_queue_messages_unacked"
	MetricQueueConsumers = "km0_rabbitmq_queue_consumers"
	// MetricSampleTime is the unix time of the snapshot the others come from.
	MetricSampleTime = "km0_lag_sample_timestamp_seconds"
	// MetricSampleErrors counts the parts the last snapshot could not measure.
	MetricSampleErrors = "km0_lag_sample_errors"
)

var (
	descGroupLag      = prometheus.NewDesc(MetricGroupLag, "Records after the consumer group's committed offset, by group, topic and partition.", []string{"grup", "topic", "particio"}, nil)
	descGroupOldest   = prometheus.NewDesc(MetricGroupOldest, "Age in seconds of the first record the group has not committed (0 when none), by group, topic and partition.", []string{"grup", "topic", "particio"}, nil)
	descOutboxPending = prometheus.NewDesc(MetricOutboxPending, "Outbox rows with publicat_en IS NULL, by outbox (measured by the lag exporter).", []string{"outbox"}, nil)
	descOutboxOldest  = prometheus.NewDesc(MetricOutboxOldest, "Age in seconds of the oldest pending outbox row (0 when none), by outbox.", []string{"outbox"}, nil)
	descOutboxWALLag  = prometheus.NewDesc(MetricOutboxWALLag, "WAL bytes a WAL-mode outbox's slot holds that its relay has not confirmed, by outbox.", []string{"outbox"}, nil)
	descOutboxWALRet  = prometheus.NewDesc(MetricOutboxWALRetained, "WAL bytes the server retains for a WAL-mode outbox's slot, by outbox.", []string{"outbox"}, nil)
	descQueueReady    = prometheus.NewDesc(MetricQueueReady, "Messages ready for delivery in the RabbitMQ queue.", []string{"cua"}, nil)
	descQueueUnacked  = prometheus.NewDesc(MetricQueueUnacked, "Messages delivered and not yet acknowledged (management API only).", []string{"cua"}, nil)
	descQueueCons     = prometheus.NewDesc(MetricQueueConsumers, "Consumers of the RabbitMQ queue.", []string{"cua"}, nil)
	descSampleTime    = prometheus.NewDesc(MetricSampleTime, "Unix time of the lag snapshot the km0 lag metrics come from.", nil, nil)
	descSampleErrors  = prometheus.NewDesc(MetricSampleErrors, "Parts (outboxes, groups, queues) the last lag snapshot could not measure.", nil, nil)
)

// Collector exports the Sampler's latest snapshot. Scrapes never measure:
// they read what the last sample found (see MetricSampleTime).
type Collector struct {
	S *Sampler
	// AllGroups exports the foreign groups too (GroupLag.Foreign). Default
	// false: only the system's groups, whatever the Sampler measured.
	AllGroups bool
}

var _ prometheus.Collector = Collector{}

// Describe implements prometheus.Collector.
func (c Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descGroupLag, descGroupOldest, descOutboxPending, descOutboxOldest, descOutboxWALLag, descOutboxWALRet,
		descQueueReady, descQueueUnacked, descQueueCons, descSampleTime, descSampleErrors} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.S.Latest()
	if s == nil {
		return
	}
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	g(descSampleTime, float64(s.At.UnixMilli())/1e3)
	g(descSampleErrors, float64(len(s.Errors)))
	if !c.AllGroups {
		s = s.WithoutForeign()
	}
	for _, gr := range s.Groups {
		for _, p := range gr.Partitions {
			part := strconv.Itoa(int(p.Partition))
			g(descGroupLag, float64(p.Lag), gr.Group, p.Topic, part)
			g(descGroupOldest, p.OldestSeconds, gr.Group, p.Topic, part)
		}
	}
	for _, o := range s.Outboxes {
		switch {
		case o.WAL != nil:
			g(descOutboxWALLag, float64(o.WAL.LagBytes), o.Name)
			g(descOutboxWALRet, float64(o.WAL.RetainedBytes), o.Name)
			if o.WAL.OldestKnown {
				g(descOutboxOldest, o.OldestSeconds, o.Name)
			}
		case o.Err == "":
			g(descOutboxPending, float64(o.Pending), o.Name)
			g(descOutboxOldest, o.OldestSeconds, o.Name)
		}
	}
	for _, q := range s.Queues {
		if q.Err != "" {
			continue
		}
		g(descQueueReady, float64(q.Ready), q.Queue)
		g(descQueueCons, float64(q.Consumers), q.Queue)
		if q.Unacked >= 0 {
			g(descQueueUnacked, float64(q.Unacked), q.Queue)
		}
	}
}
