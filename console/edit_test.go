package console_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/console"
	"github.com/km0/km0/consumer"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// orderEnvelope is a schema-valid comanda.creada of market mercat.
func orderEnvelope(t *testing.T, id, mercat string) string {
	t.Helper()
	e := &envelope.Envelope{ID: id, Type: "comanda.creada", Version: 1, TimeMS: time.Now().UnixMilli(), Origin: "comandes",
		Data: json.RawMessage(`{"id":"P-2026-7","client":"C-1","mercat":"` + mercat + `","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":250}]}`)}
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// runRefusingConsumer runs consumer group repartiment on comandes; it
// refuses for good an order of market "tancat" and records what it applied.
func (b *bundle) runRefusingConsumer(t *testing.T) (applied func() []string) {
	t.Helper()
	if _, err := migrate.Up(b.ctx, b.schema.Pool, b.schema.Names(), migrate.Inbox); err != nil {
		t.Fatal(err)
	}
	var (
		mu  sync.Mutex
		got []string
	)
	done := make(chan struct{})
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: b.brokers, Group: "repartiment", Topics: []string{comandes},
		KgoOpts: []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{Source: src, Pool: b.schema.Pool, Names: b.schema.Names(), Name: "repartiment.assignacio",
		Inbox: inbox.New(inbox.Config{Names: b.schema.Names()}), Backoff: 20 * time.Millisecond,
		Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			var d struct{ Mercat string }
			_ = json.Unmarshal(m.Envelope.Data, &d)
			if d.Mercat == "tancat" {
				return outcome.Permanentf("ciutat_no_coberta: %s", d.Mercat)
			}
			mu.Lock()
			got = append(got, m.Envelope.ID)
			mu.Unlock()
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(b.ctx)
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), got...)
	}
}

// The edit-and-replay form shows a letter's envelope; an edit that breaks
// the event's JSON Schema is refused with the problem and sends nothing; an
// edit its consumer refuses again is replayed and shown as "did not take:
// dead-lettered again"; a good edit is applied once and shown as taken. The
// original bytes stay, and the audit log page shows the edits by the
// session.
func TestEditAndReplayPageValidatesAndSaysWhetherItTook(t *testing.T) {
	t.Parallel()
	b := setupWith(t, token, func(c *console.Config) { c.ReplayWatch = 2 * time.Second })
	applied := b.runRefusingConsumer(t)
	id := uuid.NewString()
	if err := kafka.NewPublisher(b.client).Publish(b.ctx, []*transport.Message{{Topic: comandes, Key: []byte("P-2026-7"),
		Value: []byte(orderEnvelope(t, id, "tancat")), Headers: []transport.Header{{Key: "tipus", Value: "comanda.creada"},
			{Key: "id_esdeveniment", Value: id}}}}); err != nil {
		t.Fatal(err)
	}
	var letter string
	testkit.Eventually(t, 30*time.Second, "the order dead-lettered and indexed", func() bool {
		if _, err := b.svc.Sync(b.ctx); err != nil {
			t.Fatal(err)
		}
		ls, err := b.svc.List(b.ctx, dlq.Filter{EventIDs: []string{id}})
		if err != nil {
			t.Fatal(err)
		}
		if len(ls.Letters) == 1 {
			letter = ls.Letters[0].ID
		}
		return letter != ""
	})

	br := b.browser(t)
	if resp, _ := br.get("/carta/editar?id=" + url.QueryEscape(letter)); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("edit form without login: %d, want the redirect to the login", resp.StatusCode)
	}
	csrf := br.login(token)
	if _, body := br.get("/carta?id=" + url.QueryEscape(letter)); !strings.Contains(body, `id="edit-link"`) {
		t.Fatalf("the letter page has no edit link:\n%s", body)
	}
	resp, body := br.get("/carta/editar?id=" + url.QueryEscape(letter))
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="edit-value"`) || !strings.Contains(body, "&#34;tancat&#34;") {
		t.Fatalf("edit form: %d\n%s", resp.StatusCode, body)
	}
	retry := func() int64 { return b.records(t, comandesRetry) }
	send := func(value string, withToken bool) (*http.Response, string) {
		f := url.Values{"id": {letter}, "valor": {value}}
		if withToken {
			f.Set("csrf", csrf)
		}
		return br.post("/carta/editar", f)
	}
	if resp, _ := send(orderEnvelope(t, id, "olot"), false); resp.StatusCode != http.StatusForbidden || retry() != 0 {
		t.Fatalf("edit without the form token: %d, %d record(s); want 403 and nothing sent", resp.StatusCode, retry())
	}
	bad := strings.Replace(orderEnvelope(t, id, "olot"), `"linies":[{`, `"linies":"x","l":[{`, 1)
	resp, body = send(bad, true)
	if resp.StatusCode != http.StatusUnprocessableEntity || !strings.Contains(body, `id="edit-problem"`) || retry() != 0 {
		t.Fatalf("an edit that breaks the schema: %d, %d record(s)\n%s", resp.StatusCode, retry(), body)
	}
	resp, body = send(orderEnvelope(t, id, "tancat"), true)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="edit-not-taken"`) || !strings.Contains(body, "did not take: dead-lettered again") {
		t.Fatalf("an edit its consumer refuses again: %d\n%s", resp.StatusCode, body)
	}
	// The new letter of the event is the one to edit now.
	var again string
	ls, err := b.svc.List(b.ctx, dlq.Filter{EventIDs: []string{id}, States: []dlq.State{dlq.StatePending}})
	if err != nil || len(ls.Letters) != 1 {
		t.Fatalf("pending letters of the event: %v %v", ls, err)
	}
	again = ls.Letters[0].ID
	f := url.Values{"id": {again}, "valor": {orderEnvelope(t, id, "olot")}, "csrf": {csrf}}
	resp, body = br.post("/carta/editar", f)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="edit-took"`) {
		t.Fatalf("a good edit: %d\n%s", resp.StatusCode, body)
	}
	if got := applied(); len(got) != 1 || got[0] != id {
		t.Fatalf("applied %v, want the edited order once", got)
	}
	if l, err := b.svc.Get(b.ctx, again); err != nil || !strings.Contains(string(l.Value), `"tancat"`) || l.State != dlq.StateReplayed {
		t.Fatalf("the edited letter: %v %v; want replayed with its original bytes", l, err)
	}
	_, body = br.get("/auditoria")
	if strings.Count(body, `data-action="edicio"`) != 2 || !strings.Contains(body, "console:") || !strings.Contains(body, again) {
		t.Fatalf("audit log page lacks the two edits by the session:\n%s", body)
	}
}
