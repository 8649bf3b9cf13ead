package cdc

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/relay"
)

// Metric names of the CDC relay, all labelled outbox="<schema>.<table>" (and
// slot for the slot's). It also exports the polling relay's
// relay.MetricPublished, MetricParked, MetricFailures, MetricPending,
// MetricOldest, MetricTableBytes and MetricPruned, with the same meaning, so
// one dashboard serves both modes.
const (
	// MetricSlotLagBytes is pg_current_wal_lsn() - confirmed_flush_lsn of
	// the slot: WAL the relay has not confirmed, read at scrape time.
	MetricSlotLagBytes = "km0_relay_cdc_slot_lag_bytes"
	// MetricSlotRetained is pg_current_wal_lsn() - restart_lsn of the slot:
	// the WAL the server keeps for it.
	MetricSlotRetained = "km0_relay_cdc_slot_retained_wal_bytes"
	// MetricSlotLagSeconds is the age of the oldest transaction of the
	// outbox the relay received and has not confirmed yet (0 when none).
	MetricSlotLagSeconds = "km0_relay_cdc_slot_lag_seconds"
	// MetricActive is 1 while this instance holds the slot, 0 while it
	// waits for it.
	MetricActive = "km0_relay_cdc_active"
)

type metrics struct {
	published prometheus.Counter
	parked    prometheus.Counter
	failures  prometheus.Counter
	pruned    prometheus.Counter
	activeG   prometheus.Gauge
	activeNow atomic.Bool
}

func (m *metrics) active(on bool) {
	m.activeNow.Store(on)
	if on {
		m.activeG.Set(1)
	} else {
		m.activeG.Set(0)
	}
}

func newMetrics(r *Relay) (*metrics, error) {
	labels := prometheus.Labels{"outbox": r.q.payload}
	m := &metrics{
		published: prometheus.NewCounter(prometheus.CounterOpts{Name: relay.MetricPublished, ConstLabels: labels,
			Help: "Outbox rows published and confirmed by the broker, then marked."}),
		parked: prometheus.NewCounter(prometheus.CounterOpts{Name: relay.MetricParked, ConstLabels: labels,
			Help: "Outbox rows the broker (or the size limit) refused for good, parked in <outbox>_aparcats."}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{Name: relay.MetricFailures, ConstLabels: labels,
			Help: "CDC sessions that ended in a failure and were retried (broker, database or network)."}),
		pruned: prometheus.NewCounter(prometheus.CounterOpts{Name: relay.MetricPruned, ConstLabels: labels,
			Help: "Published outbox rows deleted by this relay's pruning (PruneOlderThan)."}),
		activeG: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricActive, ConstLabels: labels,
			Help: "1 while this CDC relay instance holds the replication slot, 0 while it waits."}),
	}
	if r.cfg.Metrics == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.published, m.parked, m.failures, m.pruned, m.activeG, &collector{r: r, labels: labels}} {
		if err := r.cfg.Metrics.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// collector reads the slot and the outbox at scrape time.
type collector struct {
	r      *Relay
	labels prometheus.Labels
}

func (c *collector) descs() []*prometheus.Desc {
	slot := prometheus.Labels{"outbox": c.labels["outbox"], "slot": c.r.cfg.Slot}
	return []*prometheus.Desc{
		prometheus.NewDesc(MetricSlotLagBytes, "WAL bytes between the server's position and the slot's confirmed_flush_lsn.", nil, slot),
		prometheus.NewDesc(MetricSlotRetained, "WAL bytes the server retains for the slot (current position - restart_lsn).", nil, slot),
		prometheus.NewDesc(MetricSlotLagSeconds, "Age in seconds of the oldest outbox transaction received and not confirmed (0 when none).", nil, slot),
		prometheus.NewDesc(relay.MetricPending, "Outbox rows with publicat_en IS NULL (parked ones included).", nil, c.labels),
		prometheus.NewDesc(relay.MetricOldest, "Age in seconds of the oldest pending outbox row (0 when none).", nil, c.labels),
		prometheus.NewDesc(relay.MetricTableBytes, "pg_total_relation_size of the outbox table (indexes and TOAST included).", nil, c.labels),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs() {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	d := c.descs()
	gauge := func(desc *prometheus.Desc, v float64, err error) {
		if err != nil {
			ch <- prometheus.NewInvalidMetric(desc, err)
			return
		}
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v)
	}
	s, err := c.r.SlotLag(ctx)
	if err == nil && s.Exists {
		gauge(d[0], float64(s.LagBytes), nil)
		gauge(d[1], float64(s.RetainedBytes), nil)
	} else if err != nil {
		gauge(d[0], 0, err)
		gauge(d[1], 0, err)
	}
	gauge(d[2], c.r.lag.seconds(time.Now()), nil)
	var pending int64
	var oldest float64
	err = c.r.stats.QueryRow(ctx, c.r.q.lag).Scan(&pending, &oldest)
	gauge(d[3], float64(pending), err)
	gauge(d[4], oldest, err)
	var size int64
	err = c.r.stats.QueryRow(ctx, c.r.q.size, c.r.q.table).Scan(&size)
	gauge(d[5], float64(size), err)
}

// SlotLag is the slot's state on the server.
type SlotLag struct {
	Exists        bool
	Active        bool  // a session streams from it
	LagBytes      int64 // current WAL position - confirmed_flush_lsn
	RetainedBytes int64 // current WAL position - restart_lsn
	WALStatus     string
}

// SlotLag reads the slot from pg_replication_slots.
func (r *Relay) SlotLag(ctx context.Context) (SlotLag, error) {
	var s SlotLag
	err := r.stats.QueryRow(ctx, `SELECT active, coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::int8,
		coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8, coalesce(wal_status, '')
		FROM pg_replication_slots WHERE slot_name = $1`, r.cfg.Slot).Scan(&s.Active, &s.LagBytes, &s.RetainedBytes, &s.WALStatus)
	if err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return s, nil
		}
		return s, err
	}
	s.Exists = true
	return s, nil
}

// Lag measures the pending rows of the outbox and the age of the oldest one,
// as the polling relay's Lag does. In WAL mode it counts the messages kept
// in the parking table (parked, or waiting behind a parked one): what is
// pending in the WAL is the slot's lag (SlotLag, MetricSlotLagBytes,
// MetricSlotLagSeconds).
func (r *Relay) Lag(ctx context.Context) (relay.Lag, error) {
	var l relay.Lag
	var secs float64
	if err := r.stats.QueryRow(ctx, r.q.lag).Scan(&l.Pending, &secs); err != nil {
		return relay.Lag{}, fmt.Errorf("cdc: lag: %w", err)
	}
	l.Oldest = time.Duration(secs * float64(time.Second))
	return l, nil
}
