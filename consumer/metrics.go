package consumer

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Stats are a Consumer's counts since New, the same on every source. Every
// delivered message ends in exactly one of Processed, Duplicates, Ignored,
// Foreign, Retried or DeadLettered (a message redelivered after a crash
// counts again).
type Stats struct {
	Processed    int64 // handler succeeded; effect and key committed
	Duplicates   int64 // key already recorded: redelivery absorbed, effect not run
	Ignored      int64 // tipus not in Config.Types
	Foreign      int64 // retry copies of another consumer group, skipped
	Retried      int64 // failed attempts sent to retry (Kafka <topic>.retry, RabbitMQ a wait queue)
	DeadLettered int64 // dead-lettered (<topic>.dlq, <queue>.dlq)
	Panics       int64 // handler and Decode panics recovered (each is also a failed attempt)
	// Conflicts counts transactions that PostgreSQL rolled back for a
	// deadlock (SQLSTATE 40P01) or a serialisation failure (40001) and that
	// the consumer ran again in place. It counts transactions, not records,
	// and spends no attempt of any message.
	Conflicts int64
	// Parked counts deliveries settled by parking them behind their key's
	// blocked head (Config.Order PerKey; a parked message dead-lettered as
	// blocked by its head counts in DeadLettered as well).
	Parked int64
	// Released counts parked messages applied after their head succeeded
	// (they are not deliveries: Processed does not count them).
	Released int64
}

// counters are the Stats counts, by the resultat label of
// km0_consumer_messages_total (plus panics).
type counters map[string]*atomic.Int64

func newCounters() counters {
	c := counters{}
	for _, k := range []string{resProcessed, resDuplicate, resIgnored, resForeign, resRetried, resDLQ, resPanic, resConflict, resParked, resReleased} {
		c[k] = new(atomic.Int64)
	}
	return c
}

// Stats returns the counts so far. Safe to call at any time.
func (c *Consumer) Stats() Stats {
	n := func(k string) int64 { return c.counts[k].Load() }
	return Stats{
		Processed: n(resProcessed), Duplicates: n(resDuplicate), Ignored: n(resIgnored), Foreign: n(resForeign),
		Retried: n(resRetried), DeadLettered: n(resDLQ), Panics: n(resPanic), Conflicts: n(resConflict),
		Parked: n(resParked), Released: n(resReleased),
	}
}

// Metric names.
const (
	MetricMessages = "km0_consumer_messages_total"
	MetricDLQ      = "km0_dlq_total"
	MetricHeld     = "km0_consumer_retry_held"
	// MetricConflicts counts transactions rerun in place after a deadlock or
	// a serialisation failure, by domain topic and sqlstate.
	MetricConflicts = "km0_consumer_conflicts_total"
	// MetricLag is the records of a partition this consumer owns that are
	// not done yet, up to the partition's high watermark (Kafka), by topic
	// and particio. A revoked partition's series is removed.
	MetricLag = "km0_consumer_lag"
	// MetricOldest is the age at scrape time of the oldest fetched record
	// of a partition not done yet (0 when none is), by topic and particio.
	MetricOldest = "km0_consumer_oldest_unprocessed_seconds"
)

// metrics are the Prometheus collectors of one consumer. They exist (and
// count) even when Config.Metrics is nil; then nobody scrapes them.
type metrics struct {
	messages  *prometheus.CounterVec // topic, resultat
	dlq       *prometheus.CounterVec // topic, motiu (class)
	held      prometheus.Gauge
	conflicts *prometheus.CounterVec // topic, sqlstate
	lag       *prometheus.GaugeVec   // topic, particio
	oldest    *oldestCollector
}

func newMetrics(reg prometheus.Registerer, label, name string) (*metrics, error) {
	m := &metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricMessages,
			Help: "Records finished by a km0 consumer, by topic and resultat (processat, duplicat, ignorat, alie, reintent, dlq; per-key order: aparcat, alliberat).",
		}, []string{"topic", "resultat"}),
		dlq: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricDLQ,
			Help: "Dead letters produced, by domain topic and motiu class (see contract.ReasonClass).",
		}, []string{"topic", "motiu"}),
		held: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: MetricHeld,
			Help: "Retry copies held in memory until their no_abans.",
		}),
		conflicts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricConflicts,
			Help: "Transactions of a km0 consumer rolled back by PostgreSQL for a deadlock (40P01) or serialisation failure (40001) and rerun in place, by topic and sqlstate.",
		}, []string{"topic", "sqlstate"}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: MetricLag,
			Help: "Records of a partition owned by a km0 consumer not done yet, up to the partition's high watermark, by topic and particio.",
		}, []string{"topic", "particio"}),
		oldest: newOldestCollector(),
	}
	if reg == nil {
		return m, nil
	}
	reg = prometheus.WrapRegistererWith(prometheus.Labels{"grup": label, "consumidor": name}, reg)
	var err error
	if m.messages, err = register(reg, m.messages); err != nil {
		return nil, err
	}
	if m.dlq, err = register(reg, m.dlq); err != nil {
		return nil, err
	}
	if m.held, err = register(reg, m.held); err != nil {
		return nil, err
	}
	if m.conflicts, err = register(reg, m.conflicts); err != nil {
		return nil, err
	}
	if m.lag, err = register(reg, m.lag); err != nil {
		return nil, err
	}
	if m.oldest, err = register(reg, m.oldest); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers col, or returns the collector already registered under
// the same description (a second consumer with the same group and name).
func register[C prometheus.Collector](reg prometheus.Registerer, col C) (C, error) {
	err := reg.Register(col)
	if err == nil {
		return col, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return col, fmt.Errorf("consumer: metrics: %w", err)
}

// Result labels of km0_consumer_messages_total.
const (
	resProcessed = "processat"
	resDuplicate = "duplicat"
	resIgnored   = "ignorat"
	resForeign   = "alie"
	resRetried   = "reintent"
	resDLQ       = "dlq"
	resPanic     = "panic"     // Stats only: a panic is also counted as reintent or dlq
	resConflict  = "conflicte" // Stats only: see km0_consumer_conflicts_total
	resParked    = "aparcat"   // parked behind its key's blocked head (per-key order)
	resReleased  = "alliberat" // a parked message applied after its head
)

func (c *Consumer) count(topic, res string, n int64) {
	if n == 0 {
		return
	}
	c.counts[res].Add(n)
	c.m.messages.WithLabelValues(topic, res).Add(float64(n))
}

// lag sets (n >= 0) or removes (n < 0) the km0_consumer_lag and
// km0_consumer_oldest_unprocessed_seconds of a partition.
func (c *Consumer) lag(topic string, partition int32, n int64, oldest time.Time) {
	part := strconv.Itoa(int(partition))
	if n < 0 {
		c.m.lag.DeleteLabelValues(topic, part)
		c.m.oldest.set(topic, part, time.Time{}, false)
		return
	}
	c.m.oldest.set(topic, part, oldest, true) // first: a lag read implies its age
	c.m.lag.WithLabelValues(topic, part).Set(float64(n))
}

// oldestCollector exports km0_consumer_oldest_unprocessed_seconds: the age
// is computed at scrape time from the timestamp the source reported, so it
// grows while a partition does not move.
type oldestCollector struct {
	desc *prometheus.Desc
	mu   sync.Mutex
	ts   map[[2]string]time.Time // (topic, particio) → oldest record; zero: none
}

func newOldestCollector() *oldestCollector {
	return &oldestCollector{
		desc: prometheus.NewDesc(MetricOldest,
			"Age of the oldest fetched record of a partition owned by a km0 consumer not done yet (0 when none is), by topic and particio.",
			[]string{"topic", "particio"}, nil),
		ts: map[[2]string]time.Time{},
	}
}

func (o *oldestCollector) set(topic, part string, ts time.Time, keep bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if keep {
		o.ts[[2]string{topic, part}] = ts
	} else {
		delete(o.ts, [2]string{topic, part})
	}
}

func (o *oldestCollector) Describe(ch chan<- *prometheus.Desc) { ch <- o.desc }

func (o *oldestCollector) Collect(ch chan<- prometheus.Metric) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := time.Now()
	for k, ts := range o.ts {
		age := 0.0
		if !ts.IsZero() {
			age = max(0, now.Sub(ts).Seconds())
		}
		ch <- prometheus.MustNewConstMetric(o.desc, prometheus.GaugeValue, age, k[0], k[1])
	}
}
