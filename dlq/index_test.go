package dlq_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
)

// Indexing is idempotent: a second Sync reads nothing new, and a Sync under a
// fresh group (which re-reads every record from the start) adds no row,
// raises no alert and does not reset the state of a replayed letter.
func TestSyncIsIdempotent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var first string
	for i := range 5 {
		topic := []string{comandes, inventari}[i%2]
		id, _ := b.produceDead(t, dead{topic: topic, key: "P-" + string(rune('A'+i)), reason: "permanent: esquema: x"})
		if i == 0 {
			first = id
		}
	}
	res := b.sync(t)
	if res.Read != 5 || len(res.New) != 5 || b.rows(t, "") != 5 {
		t.Fatalf("first sync: read %d, new %d, rows %d; want 5, 5, 5", res.Read, len(res.New), b.rows(t, ""))
	}
	res = b.sync(t)
	if res.Read != 0 || len(res.New) != 0 || b.rows(t, "") != 5 {
		t.Fatalf("second sync: read %d, new %d, rows %d; want 0, 0, 5", res.Read, len(res.New), b.rows(t, ""))
	}
	if _, err := b.svc.Replay(b.ctx, dlq.Filter{IDs: []string{first}}, dlq.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	// A backend in another group has no committed offsets: it re-reads all 5.
	other, err := kafkadlq.New(kafkadlq.Config{Brokers: b.broker.Addrs(), Group: "another"})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	again, err := other.Sync(b.ctx, b.store)
	if err != nil {
		t.Fatal(err)
	}
	if again.Read != 5 || len(again.New) != 0 || b.rows(t, "") != 5 {
		t.Fatalf("re-read sync: read %d, new %d, rows %d; want 5, 0, 5", again.Read, len(again.New), b.rows(t, ""))
	}
	if n := b.rows(t, dlq.StateReplayed); n != 1 {
		t.Fatalf("replayed letters after re-indexing: %d, want 1 (state must survive)", n)
	}
	// A named DLQ topic that does not exist yet holds no letters: not an error.
	named, err := kafkadlq.New(kafkadlq.Config{Brokers: b.broker.Addrs(), Group: "named",
		Topics: []string{"pagaments.esdeveniments.dlq", comandesDLQ}})
	if err != nil {
		t.Fatal(err)
	}
	defer named.Close()
	if res, err := named.Sync(b.ctx, b.store); err != nil || len(res.New) != 0 || res.Read != 3 {
		t.Fatalf("sync with a missing topic: %+v %v; want 3 read, 0 new", res, err)
	}
	total := letterCount(t, b.reg, comandes, "permanent: esquema") + letterCount(t, b.reg, inventari, "permanent: esquema")
	if total != 5 {
		t.Fatalf("km0_dlq_letters_total = %v, want 5 (one alert per letter)", total)
	}
}

// ls: counts grouped by DLQ topic and reason class, and the filters.
func TestListGroupsAndFilters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := time.Now().Add(-48 * time.Hour)
	for i := range 3 {
		b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: adreca_lliurament absent (v1) #" + string(rune('0'+i))})
	}
	for range 2 {
		b.produceDead(t, dead{topic: comandes, key: "P-2", reason: "transitori esgotat: mapes: 503 Service Unavailable", deadAt: old, attempts: 3})
	}
	b.produceDead(t, dead{topic: inventari, key: "tomaquet-rosa", reason: "permanent: estoc insuficient: tomaquet-rosa"})
	b.sync(t)

	ls := b.list(t, dlq.Filter{})
	want := map[string]int{
		comandesDLQ + "|permanent: esquema":            3,
		comandesDLQ + "|transitori esgotat: mapes":     2,
		inventariDLQ + "|permanent: estoc insuficient": 1,
	}
	if len(ls.Groups) != len(want) || len(ls.Letters) != 6 {
		t.Fatalf("groups %+v, %d rows; want %d groups, 6 rows", ls.Groups, len(ls.Letters), len(want))
	}
	for _, g := range ls.Groups {
		if want[g.Topic+"|"+g.Class] != g.Count {
			t.Fatalf("group %s %q: %d letters, want %d", g.Topic, g.Class, g.Count, want[g.Topic+"|"+g.Class])
		}
	}
	if ls.Groups[0].Count != 3 {
		t.Fatalf("largest group first: %+v", ls.Groups[0])
	}
	cases := []struct {
		name string
		f    dlq.Filter
		want int
	}{
		{"motiu prefix", dlq.Filter{Reason: "permanent"}, 4},
		{"motiu class", dlq.Filter{Reason: "transitori esgotat: mapes"}, 2},
		{"LIKE metacharacters are literal", dlq.Filter{Reason: "permanent: esq_ema"}, 0},
		{"original topic", dlq.Filter{Topic: inventari}, 1},
		{"dlq topic", dlq.Filter{Topic: comandesDLQ}, 5},
		{"since", dlq.Filter{Since: time.Now().Add(-time.Hour)}, 4},
		{"until", dlq.Filter{Until: time.Now().Add(-time.Hour)}, 2},
		{"topic and motiu", dlq.Filter{Topic: comandes, Reason: "permanent: esquema"}, 3},
		{"pending", dlq.Filter{States: []dlq.State{dlq.StatePending}}, 6},
		{"replayed", dlq.Filter{States: []dlq.State{dlq.StateReplayed}}, 0},
		{"limit", dlq.Filter{Limit: 2}, 2},
	}
	for _, c := range cases {
		got := b.list(t, c.f)
		if len(got.Letters) != c.want {
			t.Errorf("%s: %d rows, want %d", c.name, len(got.Letters), c.want)
		}
	}
}

// show: a poison letter (malformed JSON, terminal escapes, invalid UTF-8, no
// tipus/id_esdeveniment headers) is indexed, shown safely and keeps its bytes.
func TestShowMalformedLetter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	poison := []byte("{\"id_esdeveniment\": \"e-1\", \"tipus\": \x1b[31mBOOM\xff\x00")
	id, _ := b.produceDead(t, dead{topic: comandes, key: "P-9", value: poison, noIDHeaders: true,
		reason: "permanent: envelope: malformed JSON: invalid character '\\x1b'"})
	if res := b.sync(t); len(res.New) != 1 {
		t.Fatalf("the poison letter was not indexed: %+v", res)
	}
	l := b.get(t, id)
	if string(l.Value) != string(poison) || string(l.Key) != "P-9" {
		t.Fatalf("bytes changed: value %q key %q", l.Value, l.Key)
	}
	if l.EventID != "" || l.Type != "" || l.Class() != "permanent: envelope" || l.Attempts != 1 {
		t.Fatalf("letter fields: id_esdeveniment %q tipus %q class %q intents %d", l.EventID, l.Type, l.Class(), l.Attempts)
	}
	if l.OriginalTopic != comandes || l.OriginalPartition != 3 || l.OriginalOffset != 41 || l.ConsumerGroup != "repartiment" {
		t.Fatalf("original position: %s/%d/%d group %q", l.OriginalTopic, l.OriginalPartition, l.OriginalOffset, l.ConsumerGroup)
	}
	v := dlq.View(l, true)
	if v.Envelope != nil || string(v.ValueBase64) != string(poison) || !strings.Contains(v.ValueError, "malformed JSON") {
		t.Fatalf("view: envelope %s, base64 %q, error %q", v.Envelope, v.ValueBase64, v.ValueError)
	}
	text, isJSON := dlq.PrettyValue(l.Value, 0)
	if isJSON || strings.ContainsAny(text, "\x1b\x00\xff") || !strings.Contains(text, `\x1b[31mBOOM\xff\x00`) {
		t.Fatalf("unsafe or lossy rendering: %q (json %v)", text, isJSON)
	}
	if _, err := b.svc.Get(b.ctx, comandesDLQ+"/0/999"); !errors.Is(err, dlq.ErrNotFound) {
		t.Fatalf("unknown id: %v, want ErrNotFound", err)
	}
	// A valid letter pretty-prints as indented JSON.
	okID, _ := b.produceDead(t, dead{topic: comandes, key: "P-8", reason: "permanent: esquema: x"})
	b.sync(t)
	good := b.get(t, okID)
	if text, isJSON := dlq.PrettyValue(good.Value, 0); !isJSON || !strings.Contains(text, "\n  \"tipus\": \"comanda.creada\"") {
		t.Fatalf("pretty JSON: %v %s", isJSON, text)
	}
}

// Two indexes (two --schema) read through one consumer group. The first
// Sync moves the group past the letters it indexed; the second index must
// still get them: a reader starts no later than what its own index holds.
// An Indexer (a group member) obeys the same rule.
func TestASecondIndexInTheSameGroupStillGetsEveryLetter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, k := range []string{"P-1", "P-2"} {
		b.produceDead(t, dead{topic: comandes, key: k, reason: "permanent: esquema: x"})
	}
	b.sync(t) // index A; the group now has offset 2 committed
	if n := b.rows(t, dlq.StatePending); n != 2 {
		t.Fatalf("index A holds %d letters, want 2", n)
	}
	other := func() (*dlq.Store, func() int) {
		t.Helper()
		s := pgtest.NewSchema(t)
		if _, err := migrate.Up(b.ctx, s.Pool, s.Names(), dlq.Migrations); err != nil {
			t.Fatal(err)
		}
		return dlq.NewStore(s.Pool, s.Name), func() int {
			var n int
			if err := s.Pool.QueryRow(b.ctx, "SELECT count(*) FROM cartes_mortes").Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	storeB, countB := other()
	if _, err := b.backend.Sync(b.ctx, storeB); err != nil {
		t.Fatal(err)
	}
	if n := countB(); n != 2 {
		t.Fatalf("index B got %d letters from a group already past them, want 2", n)
	}
	storeC, countC := other()
	ix, err := kafkadlq.NewIndexer(kafkadlq.IndexerConfig{Kafka: kafkadlq.Config{Brokers: b.broker.Addrs()}, Store: storeC})
	if err != nil {
		t.Fatal(err)
	}
	defer runIndexer(t, b.ctx, ix)()
	testkit.Eventually(t, 10*time.Second, "index C to get the 2 letters", func() bool { return countC() == 2 })
}
