package relay

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric names, all labelled outbox="<schema>.<table>".
const (
	MetricPublished = "km0_relay_events_published_total"
	MetricParked    = "km0_relay_events_parked_total"
	MetricFailures  = "km0_relay_cycle_failures_total"
	MetricShards    = "km0_relay_owned_shards"
	MetricPending   = "km0_relay_pending_rows"
	MetricOldest    = "km0_relay_oldest_pending_seconds"
	// MetricPruned counts published rows deleted by the relay's pruning.
	MetricPruned = "km0_relay_outbox_pruned_total"
	// MetricTableBytes is pg_total_relation_size of the outbox (indexes and
	// TOAST included), read at scrape time.
	MetricTableBytes = "km0_relay_outbox_table_bytes"
)

type metrics struct {
	published prometheus.Counter
	parked    prometheus.Counter
	failures  prometheus.Counter
	shards    prometheus.Gauge
	pruned    prometheus.Counter
}

func newMetrics(r *Relay) (*metrics, error) {
	labels := prometheus.Labels{"outbox": r.q.payload}
	m := &metrics{
		published: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricPublished, ConstLabels: labels,
			Help: "Outbox rows published and confirmed by the broker, then marked."}),
		parked: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricParked, ConstLabels: labels,
			Help: "Outbox rows the broker (or the size limit) refused for good, parked in <outbox>_aparcats."}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricFailures, ConstLabels: labels,
			Help: "Claim-publish-mark cycles that failed and were rolled back (broker or database down)."}),
		shards: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricShards, ConstLabels: labels,
			Help: "Shards of the outbox this relay instance owns (of 64)."}),
		pruned: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricPruned, ConstLabels: labels,
			Help: "Published outbox rows deleted by this relay's pruning (PruneOlderThan)."}),
	}
	if r.cfg.Metrics == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.published, m.parked, m.failures, m.shards, m.pruned, &lagCollector{r: r, labels: labels}} {
		if err := r.cfg.Metrics.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// lagCollector reports the relay lag at scrape time: pending rows and
// the age of the oldest one.
type lagCollector struct {
	r      *Relay
	labels prometheus.Labels
}

func (c *lagCollector) descs() (pending, oldest, size *prometheus.Desc) {
	return prometheus.NewDesc(MetricPending, "Outbox rows with publicat_en IS NULL (parked ones included).", nil, c.labels),
		prometheus.NewDesc(MetricOldest, "Age in seconds of the oldest pending outbox row (0 when none).", nil, c.labels),
		prometheus.NewDesc(MetricTableBytes, "pg_total_relation_size of the outbox table (indexes and TOAST included).", nil, c.labels)
}

func (c *lagCollector) Describe(ch chan<- *prometheus.Desc) {
	p, o, s := c.descs()
	ch <- p
	ch <- o
	ch <- s
}

func (c *lagCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	p, o, s := c.descs()
	var size int64
	if err := c.r.stats.QueryRow(ctx, c.r.q.size, c.r.q.name).Scan(&size); err != nil {
		ch <- prometheus.NewInvalidMetric(s, err)
	} else {
		ch <- prometheus.MustNewConstMetric(s, prometheus.GaugeValue, float64(size))
	}
	lag, err := c.r.Lag(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(p, err)
		ch <- prometheus.NewInvalidMetric(o, err)
		return
	}
	ch <- prometheus.MustNewConstMetric(p, prometheus.GaugeValue, float64(lag.Pending))
	ch <- prometheus.MustNewConstMetric(o, prometheus.GaugeValue, lag.Oldest.Seconds())
}
