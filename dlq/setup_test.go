package dlq_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

const (
	comandes    = "comandes.esdeveniments"
	comandesDLQ = "comandes.esdeveniments.dlq"
	// comandesRetry is where a replay of a letter of one consumer group goes.
	comandesRetry = "comandes.esdeveniments.retry"
	inventari     = "inventari.esdeveniments"
	inventariDLQ  = "inventari.esdeveniments.dlq"
)

// bundle is what most tests need: a migrated schema, a broker with the DLQ
// topics, a Service over them and an Alerter on a private registry.
type bundle struct {
	ctx     context.Context
	schema  *pgtest.Schema
	store   *dlq.Store
	broker  *kafkaembed.Broker
	client  *kgo.Client
	adm     *kadm.Client
	backend *kafkadlq.Backend
	svc     *dlq.Service
	reg     *prometheus.Registry
	alerter *dlq.Alerter
	logs    *testlog.Buffer
}

func setup(t *testing.T) *bundle {
	t.Helper()
	ctx := context.Background()
	s := pgtest.NewSchema(t)
	if _, err := migrate.Up(ctx, s.Pool, s.Names(), dlq.Migrations, migrate.Inbox); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	b := kafkatest.New(t, comandes, comandesDLQ, comandesRetry, inventari, inventariDLQ, inventari+".retry")
	cl := kafkatest.Client(t, b)
	logs := &testlog.Buffer{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	backend, err := kafkadlq.New(kafkadlq.Config{Brokers: b.Addrs(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(backend.Close)
	reg := prometheus.NewRegistry()
	al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	store := dlq.NewStore(s.Pool, s.Name)
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: store, Backend: backend, Alerter: al, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	return &bundle{ctx: ctx, schema: s, store: store, broker: b, client: cl, adm: kadm.NewClient(cl),
		backend: backend, svc: svc, reg: reg, alerter: al, logs: logs}
}

// dead describes one dead letter as a consumer writes it (CONTRACT.md).
type dead struct {
	topic        string // original topic
	key          string
	value        []byte // default: a valid comanda.creada envelope
	eventID      string // default: a new UUID (also used in the envelope)
	reason       string
	attempts     int
	firstFailure time.Time // default: now
	eventTime    time.Time // default: now (data_ms)
	deadAt       time.Time // default: now (record timestamp)
	originalTime time.Time // data_original header; none when zero
	noIDHeaders  bool      // omit tipus/id_esdeveniment (undecodable value)
}

// event returns a valid envelope for id at t.
func event(t *testing.T, id string, at time.Time) []byte {
	t.Helper()
	e := &envelope.Envelope{ID: id, Type: "comanda.creada", Version: 1, TimeMS: at.UnixMilli(),
		Origin: "comandes", Data: json.RawMessage(`{"id":"P-2026-000123","client":"C-1","mercat":"girona","linies":[]}`)}
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// produceDead writes d to <d.topic>.dlq and returns its letter ID.
func (b *bundle) produceDead(t *testing.T, d dead) (id, eventID string) {
	t.Helper()
	now := time.Now()
	if d.eventID == "" {
		d.eventID = uuid.NewString()
	}
	if d.eventTime.IsZero() {
		d.eventTime = now
	}
	if d.firstFailure.IsZero() {
		d.firstFailure = now
	}
	if d.deadAt.IsZero() {
		d.deadAt = now
	}
	if d.value == nil {
		d.value = event(t, d.eventID, d.eventTime)
	}
	if d.attempts == 0 {
		d.attempts = 1
	}
	hs := []kgo.RecordHeader{
		{Key: "intents", Value: []byte(strconv.Itoa(d.attempts))},
		{Key: "motiu", Value: []byte(d.reason)},
		{Key: "topic_original", Value: []byte(d.topic)},
		{Key: "particio_original", Value: []byte("3")},
		{Key: "offset_original", Value: []byte("41")},
		{Key: "primera_fallada", Value: []byte(strconv.FormatFloat(float64(d.firstFailure.UnixMicro())/1e6, 'f', 6, 64))},
		{Key: "grup_consumidor", Value: []byte("repartiment")},
	}
	if !d.originalTime.IsZero() {
		hs = append(hs, kgo.RecordHeader{Key: "data_original", Value: []byte(strconv.FormatFloat(float64(d.originalTime.UnixMicro())/1e6, 'f', 6, 64))})
	}
	if !d.noIDHeaders {
		hs = append(hs, kgo.RecordHeader{Key: "tipus", Value: []byte("comanda.creada")},
			kgo.RecordHeader{Key: "id_esdeveniment", Value: []byte(d.eventID)})
	}
	r := &kgo.Record{Topic: d.topic + ".dlq", Key: []byte(d.key), Value: d.value, Headers: hs, Timestamp: d.deadAt}
	if err := b.client.ProduceSync(b.ctx, r).FirstErr(); err != nil {
		t.Fatalf("produce dead letter: %v", err)
	}
	return dlq.KafkaID(r.Topic, r.Partition, r.Offset), d.eventID
}

func (b *bundle) sync(t *testing.T) dlq.SyncResult {
	t.Helper()
	res, err := b.svc.Sync(b.ctx)
	if err != nil {
		t.Fatalf("sync: %v", err)
	}
	return res
}

// rows counts the index rows in a state ("" = all).
func (b *bundle) rows(t *testing.T, state dlq.State) int {
	t.Helper()
	var n int
	q := "SELECT count(*) FROM cartes_mortes WHERE $1 = '' OR estat = $1"
	if err := b.schema.Pool.QueryRow(b.ctx, q, string(state)).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// records is the number of records written to topic (sum of end offsets).
func (b *bundle) records(t *testing.T, topic string) int64 {
	t.Helper()
	ends, err := b.adm.ListEndOffsets(b.ctx, topic)
	if err != nil || ends.Error() != nil {
		t.Fatalf("end offsets: %v %v", err, ends.Error())
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
	return n
}

// letterCount reads km0_dlq_letters_total{topic, motiu} from the registry.
func letterCount(t *testing.T, reg *prometheus.Registry, topic, class string) float64 {
	t.Helper()
	return counter(t, reg, "km0_dlq_letters_total", map[string]string{"topic": topic, "motiu": class})
}

// counter reads the counter name{labels} from reg; 0 if absent.
func counter(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
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
			for _, l := range m.GetLabel() {
				if want, ok := labels[l.GetName()]; ok && want != l.GetValue() {
					continue metrics
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

func (b *bundle) list(t *testing.T, f dlq.Filter) *dlq.Listing {
	t.Helper()
	ls, err := b.svc.List(b.ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	return ls
}

func (b *bundle) get(t *testing.T, id string) *dlq.Letter {
	t.Helper()
	l, err := b.svc.Get(b.ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func (b *bundle) replay(t *testing.T, f dlq.Filter, o dlq.ReplayOptions) *dlq.Report {
	t.Helper()
	rep, err := b.svc.Replay(b.ctx, f, o)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	return rep
}

func ids(rep *dlq.Report, done bool) []string {
	var out []string
	for _, it := range rep.Items {
		if it.Done == done {
			out = append(out, it.ID)
		}
	}
	return out
}

// runIndexer runs ix until the returned stop is called; stop waits for Run
// and reports its error.
func runIndexer(t *testing.T, ctx context.Context, ix *kafkadlq.Indexer) (stop func()) {
	t.Helper()
	r := testkit.Start(t, "indexer", func(stopCtx context.Context) error {
		ctx, cancel := context.WithCancel(ctx) // ends with the test's ctx or at Stop
		defer context.AfterFunc(stopCtx, cancel)()
		return ix.Run(ctx)
	})
	return func() {
		if err := r.Stop(); err != nil {
			t.Errorf("indexer: %v", err)
		}
	}
}
