package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

const (
	topic = "comandes.esdeveniments"
	group = "inventari"
	name  = "inventari.descompte_estoc"
)

// bundle is one test's world: a schema with the inbox, the contract's estoc table
// and an efectes table; an embedded broker with the domain topic; a producer.
type bundle struct {
	t      *testing.T
	s      *pgtest.Schema
	b      *kafkaembed.Broker
	pub    *kgo.Client
	reg    *prometheus.Registry
	logBuf *testlog.Buffer
	log    *slog.Logger
}

func setup(t *testing.T) *bundle {
	t.Helper()
	return setupWith(t, kafkaembed.Config{})
}

// setupWith is setup on a broker configured by cfg (its Topics are set here).
func setupWith(t *testing.T, cfg kafkaembed.Config) *bundle {
	t.Helper()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	if _, err := migrate.Up(ctx, s.Pool, s.Names(), migrate.Inbox); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`CREATE TABLE estoc (producte TEXT PRIMARY KEY, unitats INTEGER NOT NULL CHECK (unitats >= 0))`,
		`INSERT INTO estoc VALUES ('tomaquet-rosa', 120), ('carbasso', 80), ('formatge-curat', 5),
		                          ('formatge-fresc', 30), ('vi-crianca', 200)`,
		`CREATE TABLE efectes (seq BIGSERIAL PRIMARY KEY, clau TEXT NOT NULL, n INTEGER NOT NULL)`,
	} {
		if _, err := s.Pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	cfg.Topics = []string{topic}
	b := kafkatest.NewWith(t, cfg)
	buf := &testlog.Buffer{}
	return &bundle{
		t: t, s: s, b: b, pub: kafkatest.Client(t, b), reg: prometheus.NewRegistry(), logBuf: buf,
		log: slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelInfo})),
	}
}

// testConfig is a consumer's configuration in these tests: the pipeline's,
// its Kafka source's (fields promoted from both), and the crash points the
// test places (internal/faults), carried in Run's context.
type testConfig struct {
	consumer.Config
	kafka.SourceConfig
	Hooks faults.Consumer[*consumer.Message]
}

// build returns the consumer.Config, with its Kafka source, or the error of
// kafka.NewSource.
func (cfg testConfig) build() (consumer.Config, error) {
	c := cfg.Config
	src, err := kafka.NewSource(cfg.SourceConfig)
	c.Source = src
	return c, err
}

// newConsumer is consumer.New of cfg.build().
func (cfg testConfig) newConsumer() (*consumer.Consumer, error) {
	c, err := cfg.build()
	if err != nil {
		return nil, err
	}
	return consumer.New(c)
}

// config is a consumer config for the bundle with test-friendly timings.
func (b *bundle) config(h consumer.Handler) testConfig {
	return testConfig{
		Config: consumer.Config{
			Name: name, Pool: b.s.Pool, Names: b.s.Names(), Handle: h, Types: []string{"comanda.creada"},
			Backoff: 50 * time.Millisecond, Logger: b.log, Metrics: b.reg,
		},
		SourceConfig: kafka.SourceConfig{
			Brokers: b.b.Addrs(), Group: group, Topics: []string{topic},
			KgoOpts: []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)},
		},
	}
}

// run starts a consumer; the returned function stops it (cancelling Run's
// context) and returns Run's error. Run's error is also sent on done.
type running struct {
	c      *consumer.Consumer
	cancel context.CancelFunc
	done   chan error
	err    error
	once   sync.Once
}

func (b *bundle) run(cfg testConfig) *running {
	b.t.Helper()
	c, err := cfg.newConsumer()
	if err != nil {
		b.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(faults.WithConsumer(context.Background(), cfg.Hooks))
	r := &running{c: c, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	b.t.Cleanup(func() { _ = r.stop() })
	return r
}

// stop cancels Run and waits for it (at most 60 s).
func (r *running) stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(60 * time.Second):
			r.err = errors.New("Run did not return within 60 s of cancel")
		}
	})
	return r.err
}

// wait waits for Run to return on its own (a crash) and returns its error.
func (r *running) wait(t *testing.T) error {
	t.Helper()
	r.once.Do(func() {
		select {
		case r.err = <-r.done:
		case <-time.After(60 * time.Second):
			t.Fatal("Run did not return within 60 s")
		}
	})
	return r.err
}

// linia and comanda are the dades of comanda.creada.
type linia struct {
	Producte  string `json:"producte"`
	Quantitat int    `json:"quantitat"`
}

type comanda struct {
	ID     string  `json:"id"`
	Linies []linia `json:"linies"`
	N      int     `json:"n"` // sequence number of the event within its key (tests)
}

// event is one envelope to publish.
type event struct {
	id, key, tipus string
	versio         int
	dades          any
}

func newEvent(key string, d comanda) event {
	return event{id: uuid.NewString(), key: key, tipus: "comanda.creada", versio: 1, dades: d}
}

func (e event) record() *kgo.Record {
	dades, _ := json.Marshal(e.dades)
	v := fmt.Sprintf(`{"id_esdeveniment":%q,"tipus":%q,"versio":%d,"data_ms":1789000000000,"origen":"comandes","dades":%s}`,
		e.id, e.tipus, e.versio, dades)
	return &kgo.Record{Topic: topic, Key: []byte(e.key), Value: []byte(v), Headers: []kgo.RecordHeader{
		{Key: "tipus", Value: []byte(e.tipus)}, {Key: "id_esdeveniment", Value: []byte(e.id)}}}
}

func (b *bundle) publish(recs ...*kgo.Record) {
	b.t.Helper()
	if err := b.pub.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		b.t.Fatal(err)
	}
}

func (b *bundle) publishEvents(evs ...event) {
	b.t.Helper()
	recs := make([]*kgo.Record, len(evs))
	for i, e := range evs {
		recs[i] = e.record()
	}
	b.publish(recs...)
}

// inventari is the contract's inventari handler: decrement each line's product if there is
// enough stock, else fail permanently (and roll everything back).
func inventari(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var d comanda
	if err := m.Envelope.DataAs(&d); err != nil {
		return err
	}
	for _, l := range d.Linies {
		tag, err := tx.Exec(ctx, `UPDATE estoc SET unitats = unitats - $1 WHERE producte = $2 AND unitats >= $1`, l.Quantitat, l.Producte)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return outcome.Permanentf("estoc insuficient: %s", l.Producte)
		}
	}
	return nil
}

// effect is a handler that records (key, n) in efectes.
func effect(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var d comanda
	if err := m.Envelope.DataAs(&d); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO efectes (clau, n) VALUES ($1, $2)`, string(m.Key), d.N)
	return err
}

func (b *bundle) count(q string, args ...any) int {
	b.t.Helper()
	var n int
	if err := b.s.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		b.t.Fatal(err)
	}
	return n
}

func (b *bundle) stock(producte string) int {
	return b.count(`SELECT unitats FROM estoc WHERE producte = $1`, producte)
}

func (b *bundle) effects() int { return b.count(`SELECT count(*) FROM efectes`) }

// committed returns the sum of the group's committed offsets on t.
func (b *bundle) committed(t string) int64 {
	b.t.Helper()
	offs, err := kadm.NewClient(b.pub).FetchOffsets(context.Background(), group)
	if errors.Is(err, kerr.GroupIDNotFound) {
		return 0 // the group has not been created yet
	}
	if err != nil {
		b.t.Fatal(err)
	}
	var sum int64
	offs.Each(func(o kadm.OffsetResponse) {
		if o.Topic == t && o.Err == nil && o.At > 0 {
			sum += o.At
		}
	})
	return sum
}

// read returns the records of a topic (waiting for n of them).
func (b *bundle) read(t string, n int) []*kgo.Record {
	return kafkatest.ReadAll(b.t, b.b, t, n, 30*time.Second)
}

func hdr(r *kgo.Record, k string) string {
	for _, h := range r.Headers {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}

// logged reports whether one log line contains every part.
func (b *bundle) logged(parts ...string) bool {
	for _, line := range strings.Split(b.logBuf.String(), "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return true
		}
	}
	return false
}

// runUntil runs a consumer until done holds for its stats, stops it cleanly
// and returns its final stats.
func (b *bundle) runUntil(cfg testConfig, what string, done func(consumer.Stats) bool) consumer.Stats {
	b.t.Helper()
	r := b.run(cfg)
	testkit.Eventually(b.t, time.Minute, what, func() bool { return done(r.c.Stats()) })
	if err := r.stop(); err != nil {
		b.t.Fatal(err)
	}
	return r.c.Stats()
}
