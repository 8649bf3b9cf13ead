package console_test

import (
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
)

// The page of a letter that is a key's blocked head shows the key's
// sequence (the messages parked behind it, in order) and replays it as one,
// with the same login and form token as every action: the head goes back to
// its topic alone and the blocked letter is marked purged.
func TestLetterPageShowsAndReplaysABlockedSequence(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	if _, err := migrate.Up(b.ctx, b.schema.Pool, b.schema.Names(), keyorder.Migrations); err != nil {
		t.Fatal(err)
	}
	ko, err := keyorder.New(keyorder.Config{Schema: b.schema.Name})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := b.schema.Pool.Begin(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ko.MarkHeadBlocked(b.ctx, tx, "pagaments.comandes", "P-2026-9", keyorder.Head{MessageID: "e-cap",
		Reason: keyorder.ReasonDeadLettered, LastError: "passarel·la: 503"}); err != nil {
		t.Fatal(err)
	}
	for i, id := range []string{"e-darrere-1", "e-darrere-2"} {
		if _, _, err := ko.Park(b.ctx, tx, "pagaments.comandes", "P-2026-9", keyorder.Message{ID: id, Topic: comandes,
			Offset: int64(i), Value: []byte(`{}`), Headers: []keyorder.Header{{Key: "tipus", Value: "comanda.cancellada"}}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(b.ctx); err != nil {
		t.Fatal(err)
	}
	letter := func(eid, motiu string) string {
		r := &kgo.Record{Topic: comandesDLQ, Key: []byte("P-2026-9"), Value: []byte(`{"id_esdeveniment":"` + eid +
			`","tipus":"comanda.creada","versio":1,"data_ms":` + jsonMS() + `,"origen":"comandes","dades":{"client":"` + customer + `"}}`),
			Timestamp: time.Now(), Headers: []kgo.RecordHeader{{Key: "motiu", Value: []byte(motiu)}, {Key: "intents", Value: []byte("3")},
				{Key: "topic_original", Value: []byte(comandes)}, {Key: "id_esdeveniment", Value: []byte(eid)}}}
		if err := b.client.ProduceSync(b.ctx, r).FirstErr(); err != nil {
			t.Fatal(err)
		}
		return dlq.KafkaID(r.Topic, r.Partition, r.Offset)
	}
	head := letter("e-cap", "transitori esgotat: passarel·la: 503")
	behind := letter("e-darrere-1", keyorder.BlockedReason("e-cap"))
	if _, err := b.svc.Sync(b.ctx); err != nil {
		t.Fatal(err)
	}

	br := b.browser(t)
	if resp, _ := br.get("/carta?id=" + url.QueryEscape(head)); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("letter page without login: %d, want the redirect to the login", resp.StatusCode)
	}
	csrf := br.login(token)
	_, body := br.get("/carta?id=" + url.QueryEscape(head))
	i1, i2 := strings.Index(body, "e-darrere-1"), strings.Index(body, "e-darrere-2")
	if !strings.Contains(body, "Blocked key <code>P-2026-9</code> (pagaments.comandes)") || i1 < 0 || i2 < i1 ||
		!strings.Contains(body, `id="replay-sequence"`) || !strings.Contains(body, behind) {
		t.Fatalf("the head's page lacks its sequence in order:\n%s", body)
	}
	if _, body := br.get("/carta?id=" + url.QueryEscape(behind)); strings.Contains(body, "replay-sequence") {
		t.Fatalf("a letter that is not a head offers a sequence replay:\n%s", body)
	}
	form := url.Values{"consumidor": {"pagaments.comandes"}, "clau": {"P-2026-9"}}
	if resp, _ := br.post("/sequencia/reproduir", form); resp.StatusCode != http.StatusForbidden || b.records(t, comandes) != 0 {
		t.Fatalf("replay without the form token: %d, %d records; want 403 and nothing published", resp.StatusCode, b.records(t, comandes))
	}
	form.Set("csrf", csrf)
	resp, body := br.post("/sequencia/reproduir", form)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b id="replayed-head">`+head+`</b>`) {
		t.Fatalf("replay: %d\n%s", resp.StatusCode, body)
	}
	if n := b.records(t, comandes); n != 1 {
		t.Fatalf("%d records on %s, want the head alone", n, comandes)
	}
	if l, err := b.svc.Get(b.ctx, behind); err != nil || l.State != dlq.StatePurged {
		t.Fatalf("the blocked letter: %v %v, want purged", l, err)
	}
}

func jsonMS() string { return strconv.FormatInt(time.Now().UnixMilli(), 10) }
