package dlq_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/migrate"
)

func letter(id, reason string) *dlq.Letter {
	return &dlq.Letter{ID: id, Topic: comandesDLQ, OriginalTopic: comandes, EventID: "e-" + id,
		Type: "comanda.creada", Reason: reason, Attempts: 3, DeadAt: time.Now()}
}

// Every dead letter: counter by topic and reason class, an error-level log
// line with id and motiu, and a webhook notice, delivered even though the
// webhook fails the first time (503, then 200).
func TestAlerterCountsLogsAndNotifiesWebhook(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	got := make(chan dlq.Notice, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		var n dlq.Notice
		if err := json.NewDecoder(r.Body).Decode(&n); err != nil || r.Header.Get("Content-Type") != "application/json" {
			t.Errorf("webhook body: %v", err)
		}
		got <- n
	}))
	defer srv.Close()
	logs := &testlog.Buffer{}
	reg := prometheus.NewRegistry()
	a, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, WebhookURL: srv.URL, WebhookBackoff: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close(context.Background())
	a.DeadLetter(context.Background(), letter("comandes.esdeveniments.dlq/2/7", "transitori esgotat: mapes: 503 from maps"))

	var n dlq.Notice
	select {
	case n = <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("the webhook never received the notice")
	}
	want := dlq.Notice{Topic: comandes, ID: "comandes.esdeveniments.dlq/2/7", EventID: "e-comandes.esdeveniments.dlq/2/7",
		Type: "comanda.creada", Reason: "transitori esgotat: mapes: 503 from maps", Attempts: 3, DLQTopic: comandesDLQ}
	n.DeadAt = time.Time{}
	if n != want {
		t.Fatalf("notice %+v, want %+v", n, want)
	}
	if c := calls.Load(); c != 2 {
		t.Fatalf("webhook called %d times, want 2 (one 503, one retry)", c)
	}
	if v := letterCount(t, reg, comandes, "transitori esgotat: mapes"); v != 1 {
		t.Fatalf("counter %v, want 1", v)
	}
	line := logs.String()
	if !strings.Contains(line, "level=ERROR") || !strings.Contains(line, "id=comandes.esdeveniments.dlq/2/7") ||
		!strings.Contains(line, `motiu="transitori esgotat: mapes: 503 from maps"`) {
		t.Fatalf("error log line missing id or motiu:\n%s", line)
	}
}

// A webhook that never answers does not block DeadLetter; with a full queue
// notices are dropped and counted, and the counter still counts every letter.
func TestAlerterWebhookNeverBlocks(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	reg := prometheus.NewRegistry()
	a, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, WebhookURL: srv.URL, WebhookQueue: 1,
		WebhookAttempts: 1, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close(context.Background())
	defer close(release) // first: lets the in-flight POST finish so Close returns
	for i := range 50 {
		a.DeadLetter(context.Background(), letter(comandesDLQ+"/0/"+string(rune('0'+i%10)), "permanent: esquema: x"))
	}
	if v := letterCount(t, reg, comandes, "permanent: esquema"); v != 50 {
		t.Fatalf("counter %v, want 50", v)
	}
	if dropped := failureCount(t, reg, "cua_plena"); dropped < 48 {
		t.Fatalf("%v notices counted as dropped, want at least 48 (queue of 1, one in flight)", dropped)
	}
}

// Reason classes bound the label cardinality.
func TestReasonClass(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"permanent: esquema: adreca_lliurament absent":         "permanent: esquema",
		"permanent: estoc insuficient":                         "permanent: estoc insuficient",
		"transitori esgotat: dial tcp 127.0.0.1:5432: refused": "transitori esgotat",
		"permanent:":     "permanent",
		"something else": contract.OtherClass,
		"":               contract.OtherClass,
		"permanent: " + strings.Repeat("x", 100) + ": detail": "permanent",
	}
	for in, want := range cases {
		if got := contract.ReasonClass(in); got != want {
			t.Errorf("ReasonClass(%q) = %q, want %q", in, got, want)
		}
	}
	reg := prometheus.NewRegistry()
	a, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, MaxClasses: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []string{"permanent: a: 1", "permanent: b: 2", "permanent: c: 3", "permanent: d: 4"} {
		a.DeadLetter(context.Background(), letter("x/0/1", r))
	}
	if v := letterCount(t, reg, comandes, contract.OtherClass); v != 2 {
		t.Fatalf("%q counted %v, want 2", contract.OtherClass, v)
	}
	if _, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, WebhookURL: "not a url"}); err == nil {
		t.Fatal("a bad webhook URL was accepted")
	}
}

// The Indexer commits offsets only after the index transaction: while the
// index cannot be written (its table does not exist yet) it commits nothing
// and loses nothing; once the table exists it indexes every letter, alerts
// once per letter, and commits.
func TestIndexerCommitsAfterTheIndexTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// An index in a schema without the table: every insert fails.
	s2 := b.schema.Name + "_later"
	if _, err := b.schema.Pool.Exec(b.ctx, "CREATE SCHEMA "+s2); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.schema.Pool.Exec(context.Background(), "DROP SCHEMA "+s2+" CASCADE") })
	store := dlq.NewStore(b.schema.Pool, s2)
	ix, err := kafkadlq.NewIndexer(kafkadlq.IndexerConfig{Kafka: kafkadlq.Config{Brokers: b.broker.Addrs(),
		Logger: slog.New(slog.NewTextHandler(b.logs, nil))}, Store: store, Alerter: b.alerter,
		RetryBackoff: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer runIndexer(t, b.ctx, ix)()
	for _, k := range []string{"P-1", "P-2", "P-3"} {
		b.produceDead(t, dead{topic: inventari, key: k, reason: "permanent: estoc insuficient: x"})
	}
	// Crash point proven: the batch was fetched, the index transaction failed;
	// the offsets must not be committed.
	testkit.Eventually(t, 10*time.Second, "the indexer to fail on the missing table", func() bool {
		return strings.Count(b.logs.String(), "cannot write the index") >= 2
	})

	if n := committed(t, b.adm); n != 0 {
		t.Fatalf("the indexer committed %d offsets without indexing", n)
	}
	if _, err := migrate.Up(b.ctx, b.schema.Pool, migrate.Names{Schema: s2}, dlq.Migrations); err != nil {
		t.Fatal(err)
	}
	count := func() int {
		var n int
		_ = b.schema.Pool.QueryRow(b.ctx, "SELECT count(*) FROM "+s2+".cartes_mortes").Scan(&n)
		return n
	}
	testkit.Eventually(t, 10*time.Second, "3 letters indexed", func() bool { return count() == 3 })
	testkit.Eventually(t, 10*time.Second, "offsets committed", func() bool { return committed(t, b.adm) == 3 })
	b.produceDead(t, dead{topic: inventari, key: "P-4", reason: "permanent: estoc insuficient: y"})
	testkit.Eventually(t, 10*time.Second, "the 4th letter indexed", func() bool { return count() == 4 })
	testkit.Eventually(t, 10*time.Second, "the 4th offset committed", func() bool { return committed(t, b.adm) == 4 })
	if v := letterCount(t, b.reg, inventari, "permanent: estoc insuficient"); v != 4 {
		t.Fatalf("counter %v, want 4 (one per letter, none for the retried batch)", v)
	}
}

// committed sums the offsets group km0.dlq.index committed on inventari's DLQ.
func committed(t *testing.T, adm *kadm.Client) int64 {
	t.Helper()
	offs, err := adm.FetchOffsetsForTopics(context.Background(), kafkadlq.GroupDefault, inventariDLQ)
	if err != nil {
		return 0
	}
	var n int64
	offs.Each(func(o kadm.OffsetResponse) {
		if o.Err == nil && o.At > 0 {
			n += o.At
		}
	})
	return n
}

func failureCount(t *testing.T, reg *prometheus.Registry, cause string) float64 {
	t.Helper()
	return counter(t, reg, "km0_dlq_webhook_failures_total", map[string]string{"causa": cause})
}

// A webhook URL carries its secret in the path or query (Slack-style
// hooks.slack.com/services/T/B/<secret>, ?token=): a webhook that cannot be
// reached is logged without the URL.
func TestAlerterWebhookFailureLogHidesTheURL(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL + "/services/T0/B0/s3cretpath?token=s3cretquery"
	srv.Close() // nothing listens there now: the POST fails with a *url.Error
	logs := &testlog.Buffer{}
	a, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: prometheus.NewRegistry(), WebhookURL: url, WebhookAttempts: 1,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	a.DeadLetter(context.Background(), letter("comandes.esdeveniments.dlq/0/1", "permanent: esquema: x"))
	if err := a.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	if !strings.Contains(out, "webhook did not take the notice") {
		t.Fatalf("no failure logged:\n%s", out)
	}
	if strings.Contains(out, "s3cret") {
		t.Fatalf("the log shows the webhook URL's secret:\n%s", out)
	}
}
