package lag_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport/amqp/amqplag"
	"github.com/km0/km0/transport/kafka/kafkalag"
)

const topic = "comandes.esdeveniments"

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// kafkaLag starts a broker where group "inventari" committed offset 2 of the
// 5 records of partition 0 (written 10 minutes ago, a minute apart) and all
// 3 of partition 1.
// kafkaProbe is the Kafka probe of brokers; the Measurer closes it.
func kafkaProbe(t *testing.T, brokers []string) *kafkalag.Probe {
	t.Helper()
	p, err := kafkalag.New(kafkalag.Config{Brokers: brokers, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func kafkaLag(t *testing.T) (brokers []string, adm *kadm.Client, base time.Time) {
	t.Helper()
	b := kafkatest.New(t, topic)
	cl := kafkatest.Client(t, b, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	ctx := context.Background()
	base = time.Now().Add(-10 * time.Minute).Truncate(time.Millisecond)
	var recs []*kgo.Record
	for i := 0; i < 5; i++ {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: 0, Value: []byte("x"), Timestamp: base.Add(time.Duration(i) * time.Minute)})
	}
	for i := 0; i < 3; i++ {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: 1, Value: []byte("y"), Timestamp: base})
	}
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	adm = kadm.NewClient(cl)
	commit(t, adm, map[int32]int64{0: 2, 1: 3})
	return b.Addrs(), adm, base
}

func commit(t *testing.T, adm *kadm.Client, offs map[int32]int64) {
	t.Helper()
	var o kadm.Offsets
	for p, at := range offs {
		o.Add(kadm.Offset{Topic: topic, Partition: p, At: at, LeaderEpoch: -1})
	}
	resp, err := adm.CommitOffsets(context.Background(), "inventari", o)
	if err == nil {
		err = resp.Error()
	}
	if err != nil {
		t.Fatalf("commit: %v", err)
	}
}

func group(t *testing.T, s *lag.Snapshot, name string) lag.GroupLag {
	t.Helper()
	for _, g := range s.Groups {
		if g.Group == name {
			return g
		}
	}
	t.Fatalf("group %s not in the snapshot: %+v", name, s.Groups)
	return lag.GroupLag{}
}

// A group's lag per partition is its committed offset against the end, and
// its oldest age is the timestamp of the first record it has not committed.
func TestMeasureKafkaGroup(t *testing.T) {
	t.Parallel()
	brokers, _, base := kafkaLag(t)
	m, err := lag.NewMeasurer(lag.Config{Kafka: kafkaProbe(t, brokers), Groups: []string{"inventari"}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	s, err := m.Measure(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	g := group(t, s, "inventari")
	if g.Total != 3 || len(s.Errors) != 0 {
		t.Fatalf("group lag %d (errors %v), want 3", g.Total, s.Errors)
	}
	byPart := map[int32]lag.PartitionLag{}
	for _, p := range g.Partitions {
		byPart[p.Partition] = p
	}
	p0, p1 := byPart[0], byPart[1]
	if p0.Committed != 2 || p0.End != 5 || p0.Lag != 3 || p1.Lag != 0 || p1.Committed != 3 {
		t.Fatalf("partitions: %+v %+v", p0, p1)
	}
	// The first unprocessed record of partition 0 is offset 2, stamped base+2m.
	want := s.At.Sub(base.Add(2 * time.Minute)).Seconds()
	if p0.OldestSeconds < want-1 || p0.OldestSeconds > want+1 || g.OldestSeconds != p0.OldestSeconds || p1.OldestSeconds != 0 {
		t.Fatalf("oldest: partition 0 %.1fs (want %.1fs), group %.1fs, partition 1 %.1fs", p0.OldestSeconds, want, g.OldestSeconds, p1.OldestSeconds)
	}
}

// An outbox's lag is its unpublished rows and the age of the oldest.
func TestMeasureOutbox(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: s.Names()})
	for i := 0; i < 3; i++ {
		if err := ob.Enqueue(ctx, s.Pool, &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: map[string]any{"i": i}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox SET creat_en = now() - interval '90 seconds'
		WHERE id = (SELECT id FROM outbox ORDER BY creat_en LIMIT 1)`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox SET publicat_en = now()
		WHERE id = (SELECT id FROM outbox ORDER BY creat_en DESC LIMIT 1)`); err != nil {
		t.Fatal(err)
	}
	m, err := lag.NewMeasurer(lag.Config{Outboxes: []lag.Outbox{{Name: "comandes", DB: s.Pool, Names: s.Names()}}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := m.Measure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	o := snap.Outboxes[0]
	if o.Pending != 2 || o.OldestSeconds < 89 || o.OldestSeconds > 150 || o.Err != "" {
		t.Fatalf("outbox lag: %+v", o)
	}
	s.Pool.Close() // the database goes away: reported, without internals
	snap, _ = m.Measure(ctx)
	if o := snap.Outboxes[0]; o.Err == "" || len(snap.Errors) != 1 || strings.Contains(snap.Errors[0], "closed") {
		t.Fatalf("outbox with its database down: %+v %v", o, snap.Errors)
	}
}

// A RabbitMQ queue's ready messages come from the broker (unacked needs the
// management API: unknown without it); a missing queue is reported.
func TestMeasureQueue(t *testing.T) {
	t.Parallel()
	amqptest.Shared(t)
	conn := amqptest.Dial(t)
	q := amqptest.Name("km0.lagtest")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{q, q + ".dlq"} })
	err := conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		for _, n := range []string{q, q + ".dlq"} {
			if _, err := ch.QueueDeclare(n, true, false, false, false, nil); err != nil {
				return err
			}
		}
		for i := 0; i < 4; i++ {
			if err := ch.PublishWithContext(context.Background(), "", q, false, false, amqp091.Publishing{Body: []byte("x")}); err != nil {
				return err
			}
		}
		return ch.PublishWithContext(context.Background(), "", q+".dlq", false, false, amqp091.Publishing{Body: []byte("d")})
	})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "4 messages in the queue", func() bool { return amqptest.QueueLen(t, conn, q) == 4 })
	m, err := lag.NewMeasurer(lag.Config{RabbitMQ: amqplag.New(conn), Queues: []string{q, q + ".absent"}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	s, err := m.Measure(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Queues) != 3 {
		t.Fatalf("queues: %+v", s.Queues)
	}
	work, dead, absent := s.Queues[0], s.Queues[1], s.Queues[2]
	if work.Queue != q || work.Ready != 4 || work.Unacked != -1 || dead.Queue != q+".dlq" || dead.Ready != 1 {
		t.Fatalf("queues: %+v %+v", work, dead)
	}
	if absent.Err == "" || len(s.Errors) != 1 || strings.Contains(s.Errors[0], "127.0.0.1") {
		t.Fatalf("absent queue: %+v, errors %v", absent, s.Errors)
	}
}

// webhook records the JSON bodies it receives.
type webhook struct {
	mu     sync.Mutex
	bodies []dlq.LagNotice
	srv    *httptest.Server
}

func newWebhook(t *testing.T) *webhook {
	w := &webhook{}
	w.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		var n dlq.LagNotice
		if err := json.NewDecoder(r.Body).Decode(&n); err != nil {
			t.Errorf("webhook body: %v", err)
		}
		w.mu.Lock()
		w.bodies = append(w.bodies, n)
		w.mu.Unlock()
	}))
	t.Cleanup(w.srv.Close)
	return w
}

func (w *webhook) got() []dlq.LagNotice {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]dlq.LagNotice(nil), w.bodies...)
}

// The DLQ webhook gets a lag alert once a group's measured lag has been over
// the threshold for the duration, once (not at every sample), and a
// "resolta" notice when the group caught up.
func TestLagAlertThroughTheDLQWebhook(t *testing.T) {
	t.Parallel()
	brokers, adm, _ := kafkaLag(t)
	hook := newWebhook(t)
	al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: prometheus.NewRegistry(), Logger: quiet, WebhookURL: hook.srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	clock := func() time.Time { return now }
	m, err := lag.NewMeasurer(lag.Config{Kafka: kafkaProbe(t, brokers), Groups: []string{"inventari"}, Logger: quiet, Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	watch := lag.NewWatch(lag.Rule{MaxLag: 2, For: time.Minute}, al)
	s := lag.NewSampler(lag.SamplerConfig{Measurer: m, Watch: watch, Logger: quiet})
	ctx := context.Background()
	sample := func() {
		t.Helper()
		if _, err := s.Sample(ctx); err != nil {
			t.Fatal(err)
		}
	}
	sample() // lag 3 > 2 from now on
	now = now.Add(59 * time.Second)
	sample()
	if len(watch.Firing()) != 0 {
		t.Fatal("alert raised before the duration")
	}
	now = now.Add(time.Second)
	sample() // over for 60 s: alert
	now = now.Add(time.Minute)
	sample() // still over: no second alert
	commit(t, adm, map[int32]int64{0: 5})
	now = now.Add(time.Minute)
	sample()                              // caught up: resolved
	if err := al.Close(ctx); err != nil { // delivers what is queued
		t.Fatal(err)
	}
	got := hook.got()
	if len(got) != 2 {
		t.Fatalf("webhook got %d notices, want 2 (alerta, resolta): %+v", len(got), got)
	}
	a, r := got[0], got[1]
	if a.Avis != "lag" || a.Estat != "alerta" || a.Objecte != "grup inventari" || a.Lag != 3 || a.MaxLag != 2 || a.At.Sub(a.Since) != time.Minute {
		t.Fatalf("alert notice: %+v", a)
	}
	if r.Estat != "resolta" || r.Objecte != "grup inventari" || r.Lag != 0 {
		t.Fatalf("resolved notice: %+v", r)
	}
	if len(s.History()) != 5 {
		t.Fatalf("history: %d points, want 5", len(s.History()))
	}
}

// A lag under the threshold, or over it for less than the duration, sends
// nothing; an age threshold alerts on its own.
func TestWatchThresholds(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t)
	al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: prometheus.NewRegistry(), Logger: quiet, WebhookURL: hook.srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	w := lag.NewWatch(lag.Rule{MaxLag: 100, MaxAge: time.Minute, For: 30 * time.Second}, al)
	t0 := time.Now()
	snap := func(at time.Duration, pending int64, oldest float64) *lag.Snapshot {
		return &lag.Snapshot{At: t0.Add(at), Outboxes: []lag.OutboxLag{{Name: "comandes", Pending: pending, OldestSeconds: oldest}}}
	}
	ctx := context.Background()
	w.Evaluate(ctx, snap(0, 100, 10))              // at the threshold: not over
	w.Evaluate(ctx, snap(10*time.Second, 500, 10)) // over
	w.Evaluate(ctx, snap(20*time.Second, 1, 10))   // back under within 30 s: nothing sent
	w.Evaluate(ctx, snap(30*time.Second, 1, 61))   // too old
	w.Evaluate(ctx, snap(60*time.Second, 1, 91))   // 30 s too old: alert
	if err := al.Close(ctx); err != nil {
		t.Fatal(err)
	}
	got := hook.got()
	if len(got) != 1 || got[0].Objecte != "outbox comandes" || got[0].Estat != "alerta" || got[0].OldestSeconds != 91 {
		t.Fatalf("notices: %+v", got)
	}
}

// The exporter's metrics are the latest snapshot's numbers.
func TestCollector(t *testing.T) {
	t.Parallel()
	s := lag.NewSampler(lag.SamplerConfig{Measurer: nil})
	s.Add(&lag.Snapshot{At: time.Now(),
		Groups: []lag.GroupLag{{Group: "inventari", Total: 3, Partitions: []lag.PartitionLag{{Topic: topic, Partition: 0, Lag: 3, OldestSeconds: 480}}}},
		Outboxes: []lag.OutboxLag{{Name: "comandes", Pending: 7, OldestSeconds: 2},
			{Name: "pagaments", OldestSeconds: 30, WAL: &lag.SlotLag{LagBytes: 592, RetainedBytes: 4096, OldestKnown: true}},
			{Name: "inventari", WAL: &lag.SlotLag{LagBytes: 100, RetainedBytes: 200, Active: true}}},
		Queues: []lag.QueueLag{{Queue: "q", Ready: 4, Unacked: -1, Consumers: 1}}})
	reg := prometheus.NewRegistry()
	reg.MustRegister(lag.Collector{S: s})
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{lag.MetricGroupLag, map[string]string{"grup": "inventari", "topic": topic, "particio": "0"}, 3},
		{lag.MetricGroupOldest, map[string]string{"grup": "inventari", "topic": topic, "particio": "0"}, 480},
		{lag.MetricOutboxPending, map[string]string{"outbox": "comandes"}, 7},
		{lag.MetricOutboxWALLag, map[string]string{"outbox": "pagaments"}, 592},
		{lag.MetricOutboxWALRetained, map[string]string{"outbox": "pagaments"}, 4096},
		{lag.MetricOutboxOldest, map[string]string{"outbox": "pagaments"}, 30},
		{lag.MetricOutboxWALLag, map[string]string{"outbox": "inventari"}, 100},
		{lag.MetricQueueReady, map[string]string{"cua": "q"}, 4},
		{lag.MetricQueueConsumers, map[string]string{"cua": "q"}, 1},
	} {
		if v, ok := gauge(t, reg, c.name, c.labels); !ok || v != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, v, ok, c.want)
		}
	}
	if _, ok := gauge(t, reg, lag.MetricQueueUnacked, map[string]string{"cua": "q"}); ok {
		t.Error("unacked exported while unknown")
	}
	// A WAL-mode outbox has no pending rows, and a streaming slot's age is unknown.
	for _, c := range []struct{ name, outbox string }{{lag.MetricOutboxPending, "pagaments"}, {lag.MetricOutboxOldest, "inventari"}} {
		if _, ok := gauge(t, reg, c.name, map[string]string{"outbox": c.outbox}); ok {
			t.Errorf("%s exported for the WAL outbox %s", c.name, c.outbox)
		}
	}
}

// gauge reads name{labels} from reg.
func gauge(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue metrics
				}
			}
			return m.GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// The logical queue of an ordered consumer has no queue of its own: asked
// for it, the Measurer reports its shard queues <queue>.<i> and its one DLQ,
// and no error, as km0 dlq --queue takes the same name.
func TestMeasureOrderedQueueByItsLogicalName(t *testing.T) {
	t.Parallel()
	amqptest.Shared(t)
	conn := amqptest.Dial(t)
	q := amqptest.Name("km0.lagordered")
	names := []string{q + ".0", q + ".1", q + ".dlq"}
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return names })
	err := conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		for _, n := range names {
			if _, err := ch.QueueDeclare(n, true, false, false, false, nil); err != nil {
				return err
			}
		}
		for _, n := range []string{q + ".0", q + ".0", q + ".1", q + ".dlq"} {
			if err := ch.PublishWithContext(context.Background(), "", n, false, false, amqp091.Publishing{Body: []byte("x")}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the messages in the shards", func() bool {
		return amqptest.QueueLen(t, conn, q+".0") == 2 && amqptest.QueueLen(t, conn, q+".1") == 1 && amqptest.QueueLen(t, conn, q+".dlq") == 1
	})

	m, err := lag.NewMeasurer(lag.Config{RabbitMQ: amqplag.New(conn), Queues: []string{q}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	s, err := m.Measure(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ql := range s.Queues {
		got = append(got, fmt.Sprintf("%s ready %d err %q", ql.Queue, ql.Ready, ql.Err))
	}
	want := []string{q + `.0 ready 2 err ""`, q + `.1 ready 1 err ""`, q + `.dlq ready 1 err ""`}
	if !slices.Equal(got, want) || len(s.Errors) != 0 {
		t.Fatalf("queues %q, errors %v; want %q and none", got, s.Errors, want)
	}
}
