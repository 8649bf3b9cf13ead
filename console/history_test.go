package console_test

import (
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
)

// historyAt is the first failed attempt of produceWithHistory's letter.
var historyAt = time.Date(2026, 3, 1, 10, 0, 0, 0, time.UTC)

// produceWithHistory writes one dead letter of comandes whose attempt
// history (historial_intents) holds errors, one with markup, and syncs.
func (b *bundle) produceWithHistory(t *testing.T) string {
	t.Helper()
	h := contract.FormatHistory([]contract.FailedAttempt{
		{N: 1, At: historyAt, Error: "transient: pagaments did not answer in 5s"},
		{N: 2, At: historyAt.Add(time.Minute), Error: "transient: pagaments refused: <script>alert(1)</script>"},
		{N: 3, At: historyAt.Add(3 * time.Minute), Error: "permanent: esquema: preu negatiu"},
	})
	r := &kgo.Record{Topic: comandesDLQ, Key: []byte("P-2026-700"), Value: []byte(`{"id_esdeveniment":"e-700","tipus":"comanda.creada","versio":1,"data_ms":1772359200000,"origen":"comandes","dades":{"id":"P-2026-700","preu":-3}}`), Timestamp: historyAt.Add(3 * time.Minute),
		Headers: []kgo.RecordHeader{{Key: contract.HeaderAttempts, Value: []byte("3")}, {Key: contract.HeaderReason, Value: []byte("permanent: esquema: preu negatiu")},
			{Key: contract.HeaderOriginalTopic, Value: []byte(comandes)}, {Key: contract.HeaderHistory, Value: []byte(h)},
			{Key: contract.HeaderFirstFailure, Value: []byte(contract.FormatTime(historyAt))}, {Key: contract.HeaderGroup, Value: []byte("pagaments.cobrament")},
			{Key: "tipus", Value: []byte("comanda.creada")}, {Key: "id_esdeveniment", Value: []byte("e-700")}}}
	if err := b.client.ProduceSync(b.ctx, r).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
	if _, err := b.svc.Sync(b.ctx); err != nil {
		t.Fatalf("sync: %v", err)
	}
	return dlq.KafkaID(r.Topic, r.Partition, r.Offset)
}

// The letter page shows the attempt history: each attempt's number, time
// as a date and error, escaped.
func TestLetterPageShowsTheAttemptHistory(t *testing.T) {
	b := setup(t, token)
	id := b.produceWithHistory(t)
	br := b.browser(t)
	br.login(token)
	resp, body := br.get("/carta?id=" + url.QueryEscape(id))
	if resp.StatusCode != 200 {
		t.Fatalf("GET /carta: %d\n%s", resp.StatusCode, body)
	}
	i := strings.Index(body, `<table id="history">`)
	if i < 0 {
		t.Fatalf("the letter page has no attempt history:\n%s", body)
	}
	table := body[i : i+strings.Index(body[i:], "</table>")]
	for _, want := range []string{
		"<td>1</td><td>2026-03-01 10:00:00Z</td><td>transient: pagaments did not answer in 5s</td>",
		"<td>2</td><td>2026-03-01 10:01:00Z</td><td>transient: pagaments refused: &lt;script&gt;alert(1)&lt;/script&gt;</td>",
		"<td>3</td><td>2026-03-01 10:03:00Z</td><td>permanent: esquema: preu negatiu</td>",
	} {
		if !strings.Contains(table, want) {
			t.Errorf("attempt history lacks %q:\n%s", want, table)
		}
	}
	if strings.Contains(body, "<script>alert(1)") {
		t.Fatal("an attempt's error reaches the page unescaped")
	}
}
