package dlq_test

import (
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
)

// poison is one forged dead letter: the headers it overrides.
type poison struct {
	name    string
	headers map[string]string
}

// noise returns n bytes of lowercase letters that do not compress: a btree
// index compresses a long repetitive value below its row limit.
func noise(n int) string {
	r := rand.New(rand.NewPCG(1, uint64(n)))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + r.IntN(26))
	}
	return string(b)
}

// poisons are the forged letters that used to stop the index: an intents
// beyond the INTEGER column, a negative one, a motiu and a topic_original
// too long for a btree index row, invalid UTF-8 and a NUL byte, and (with
// the CHECK constraint the tests add) a letter the index refuses whatever is
// done to it.
func poisons() []poison {
	return []poison{
		{"intents=2147483648", map[string]string{"intents": "2147483648"}},
		{"intents=-5", map[string]string{"intents": "-5"}},
		{"motiu of 8000", map[string]string{"motiu": "permanent: esquema: " + noise(8000)}},
		{"topic_original of 4000", map[string]string{"topic_original": noise(4000)}},
		{"invalid UTF-8", map[string]string{"motiu": "permanent: esquema: \xff\xfe", "grup_consumidor": "g\xc3"}},
		{"NUL", map[string]string{"motiu": "permanent: esquema: a\x00b", "tipus": "comanda\x00creada"}},
		{"refused", map[string]string{"tipus": "verinos"}},
	}
}

// refuseVerinos makes the index refuse a letter of tipus "verinos", as it
// would any letter PostgreSQL refuses for a reason km0 does not foresee.
func refuseVerinos(t *testing.T, s *pgtest.Schema) {
	t.Helper()
	if _, err := s.Pool.Exec(t.Context(), `ALTER TABLE cartes_mortes ADD CONSTRAINT prova_verinos
		CHECK (tipus IS DISTINCT FROM 'verinos')`); err != nil {
		t.Fatal(err)
	}
}

// producePoisons writes the poisons, then one good letter, to comandes.dlq;
// it returns the IDs in that order (the good one last).
func (b *bundle) producePoisons(t *testing.T) []string {
	t.Helper()
	var out []string
	for _, p := range append(poisons(), poison{name: "good"}) {
		eid := uuid.NewString()
		h := map[string]string{"intents": "3", "motiu": "permanent: esquema: x", "topic_original": comandes,
			"particio_original": "0", "offset_original": "7", "grup_consumidor": "repartiment",
			"tipus": "comanda.creada", "id_esdeveniment": eid,
			"primera_fallada": strconv.FormatInt(time.Now().Unix(), 10)}
		for k, v := range p.headers {
			h[k] = v
		}
		r := &kgo.Record{Topic: comandesDLQ, Key: []byte("P-1"), Value: event(t, eid, time.Now())}
		for _, k := range []string{"intents", "motiu", "topic_original", "particio_original", "offset_original",
			"grup_consumidor", "tipus", "id_esdeveniment", "primera_fallada"} {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(h[k])})
		}
		if err := b.client.ProduceSync(b.ctx, r).FirstErr(); err != nil {
			t.Fatalf("produce %s: %v", p.name, err)
		}
		out = append(out, dlq.KafkaID(r.Topic, r.Partition, r.Offset))
	}
	return out
}

// sumCounter adds up every series of the counter name in reg.
func sumCounter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// One forged dead letter must never hide the others. Each poison is
// followed, on the same partition, by a good letter; Sync and a running
// Indexer (each into its own index) index the good letter and alert it,
// index the forged ones clamped and cut (the full text stays in the stored
// headers) and set aside the one the index refuses: recorded in
// cartes_refusades, counted, logged once and shown by List.
func TestForgedLettersNeverStopTheKafkaIndex(t *testing.T) {
	t.Parallel()
	b := setup(t)
	refuseVerinos(t, b.schema)
	ids := b.producePoisons(t)
	good, refused := ids[len(ids)-1], ids[len(ids)-2]

	res, err := b.svc.Sync(b.ctx)
	if err != nil {
		t.Fatalf("sync: %v", err)
	}
	if res.Read != 8 || len(res.New) != 7 || len(res.Refused) != 1 || res.Refused[0].ID != refused {
		t.Fatalf("sync: read %d, new %d, refused %+v; want 8, 7 and %s", res.Read, len(res.New), res.Refused, refused)
	}
	checkPoisonsIndexed(t, b.store, ids)
	if n := sumCounter(t, b.reg, "km0_dlq_letters_total"); n != 7 {
		t.Fatalf("km0_dlq_letters_total = %v, want 7", n)
	}
	if n := sumCounter(t, b.reg, "km0_dlq_refused_total"); n != 1 {
		t.Fatalf("km0_dlq_refused_total = %v, want 1", n)
	}
	ls := b.list(t, dlq.Filter{Topic: comandesDLQ})
	if len(ls.Letters) != 7 || ls.Refused != 1 {
		t.Fatalf("list: %d letters, %d refused; want 7 and 1", len(ls.Letters), ls.Refused)
	}
	// The letter whose topic_original was cut has nowhere to go back to:
	// replay refuses it, even forced, and publishes nothing.
	rep, err := b.svc.Replay(b.ctx, dlq.Filter{IDs: []string{ids[3]}}, dlq.ReplayOptions{Force: true})
	if err != nil || rep.Refused != 1 || !strings.Contains(rep.Items[0].Refused, "was cut in the index") {
		t.Fatalf("replay of the cut topic_original: %+v, %v; want it refused", rep, err)
	}
	// A fresh group re-reads all 8: nothing new, the refusal is not logged
	// or counted twice.
	other, err := kafkadlq.New(kafkadlq.Config{Brokers: b.broker.Addrs(), Group: "again"})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	again, err := other.Sync(b.ctx, b.store)
	if err != nil || again.Read != 8 || len(again.New) != 0 || len(again.Refused) != 0 {
		t.Fatalf("re-read: %+v, %v; want 8 read, 0 new, 0 newly refused", again, err)
	}
	if n := strings.Count(b.logs.String(), "dlq: letter refused by the index"); n != 1 {
		t.Fatalf("the refusal was logged %d times, want once:\n%s", n, b.logs.String())
	}

	// The Indexer, into an index of its own with the same CHECK.
	s := pgtest.NewSchema(t)
	if _, err := migrate.Up(b.ctx, s.Pool, s.Names(), dlq.Migrations); err != nil {
		t.Fatal(err)
	}
	refuseVerinos(t, s)
	store := dlq.NewStore(s.Pool, s.Name)
	reg := prometheus.NewRegistry()
	al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ix, err := kafkadlq.NewIndexer(kafkadlq.IndexerConfig{Kafka: kafkadlq.Config{Brokers: b.broker.Addrs()}, Store: store,
		Alerter: al, RetryBackoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	stop := runIndexer(t, b.ctx, ix)
	testkit.Eventually(t, 15*time.Second, "the indexer to index the good letter", func() bool {
		_, err := store.Get(b.ctx, good)
		return err == nil
	})

	stop()
	checkPoisonsIndexed(t, store, ids)
	if n, r := sumCounter(t, reg, "km0_dlq_letters_total"), sumCounter(t, reg, "km0_dlq_refused_total"); n != 7 || r != 1 {
		t.Fatalf("indexer: km0_dlq_letters_total = %v, km0_dlq_refused_total = %v; want 7 and 1", n, r)
	}
}

// checkPoisonsIndexed checks what the index holds of the letters of
// producePoisons: 7 rows, each forged value bounded to its column, the full
// text in the stored headers, and the refused letter in cartes_refusades.
func checkPoisonsIndexed(t *testing.T, st *dlq.Store, ids []string) {
	t.Helper()
	ctx := t.Context()
	all, err := st.List(ctx, dlq.Filter{})
	if err != nil || len(all) != 7 {
		t.Fatalf("index: %d letters, %v; want 7", len(all), err)
	}
	get := func(i int) *dlq.Letter {
		l, err := st.Get(ctx, ids[i])
		if err != nil {
			t.Fatalf("%s: %v", poisons()[i].name, err)
		}
		return l
	}
	if l := get(0); l.Attempts != math.MaxInt32 {
		t.Fatalf("intents=2147483648 indexed as %d, want %d", l.Attempts, math.MaxInt32)
	}
	if l := get(1); l.Attempts != 0 {
		t.Fatalf("intents=-5 indexed as %d, want 0", l.Attempts)
	}
	l := get(2)
	if len(l.Reason) != dlq.MaxIndexedText || !strings.HasPrefix(l.Reason, "permanent: esquema: "+noise(8000)[:100]) || l.Class() != "permanent: esquema" {
		t.Fatalf("motiu of 8000: indexed %d bytes, class %q; want %d", len(l.Reason), l.Class(), dlq.MaxIndexedText)
	}
	if v, _ := header(l, "motiu"); len(v) != len("permanent: esquema: ")+8000 {
		t.Fatalf("motiu of 8000: the stored header holds %d bytes, want all of them", len(v))
	}
	l = get(3)
	if len(l.OriginalTopic) != dlq.MaxIndexedText || !strings.HasPrefix(noise(4000), l.OriginalTopic) {
		t.Fatalf("topic_original of 4000: indexed %d bytes, want %d", len(l.OriginalTopic), dlq.MaxIndexedText)
	}
	if v, _ := header(l, "topic_original"); len(v) != 4000 {
		t.Fatalf("topic_original of 4000: the stored header holds %d bytes", len(v))
	}
	if l := get(4); l.Reason != "permanent: esquema: \uFFFD" || l.ConsumerGroup != "g\uFFFD" {
		t.Fatalf("invalid UTF-8: motiu %q, group %q", l.Reason, l.ConsumerGroup)
	}
	if v, _ := header(get(4), "motiu"); v != "permanent: esquema: \xff\xfe" {
		t.Fatalf("invalid UTF-8: stored header %q, want the exact bytes", v)
	}
	if l := get(5); l.Reason != "permanent: esquema: a\uFFFDb" || l.Type != "comanda\uFFFDcreada" {
		t.Fatalf("NUL: motiu %q, tipus %q", l.Reason, l.Type)
	}
	if _, err := st.Get(ctx, ids[6]); err == nil {
		t.Fatalf("the refused letter is in the index")
	}
	if l := get(7); l.Reason != "permanent: esquema: x" || l.Attempts != 3 {
		t.Fatalf("good letter: %+v", l)
	}
	refused, err := st.Refused(ctx, dlq.Filter{})
	if err != nil || len(refused) != 1 {
		t.Fatalf("refused: %+v, %v; want 1", refused, err)
	}
	r := refused[0]
	if r.ID != ids[6] || r.Topic != comandesDLQ || r.Code != "23514" || !strings.Contains(r.Error, "prova_verinos") || r.At.IsZero() {
		t.Fatalf("refused letter: %+v", r)
	}
}

// header returns the value of the stored header k of l.
func header(l *dlq.Letter, k string) (string, bool) {
	for _, h := range l.Headers {
		if h.Key == k {
			return h.Value, true
		}
	}
	return "", false
}
