package console_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/migrate"
)

const (
	comandes    = "comandes.esdeveniments"
	comandesDLQ = "comandes.esdeveniments.dlq"
	// comandesRetry is where a replay of a letter of one consumer group
	// goes (dlq.Backend.Publish).
	comandesRetry = "comandes.esdeveniments.retry"
	token         = "s3cret-admin-token"
	// customer is customer data inside every letter's envelope: it must
	// never be shown without the token.
	customer = "C-CONFIDENCIAL-77"
)

type bundle struct {
	ctx    context.Context
	schema *pgtest.Schema
	client *kgo.Client
	adm    *kadm.Client
	svc    *dlq.Service
	con    *console.Console
	srv    *httptest.Server
	logs   *testlog.Buffer
	// brokers are the addresses of the test's Kafka broker.
	brokers []string
}

// setup starts a broker with the DLQ topic, a migrated index, a Service and
// a console with token tok ("" = none) behind an httptest server.
func setup(t *testing.T, tok string) *bundle { t.Helper(); return setupWith(t, tok, nil) }

// setupWith is setup with more of the console's Config set by more.
func setupWith(t *testing.T, tok string, more func(*console.Config)) *bundle {
	t.Helper()
	ctx := context.Background()
	s := pgtest.NewSchema(t)
	if _, err := migrate.Up(ctx, s.Pool, s.Names(), dlq.Migrations); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	b := kafkatest.New(t, comandes, comandesDLQ, comandesRetry)
	cl := kafkatest.Client(t, b)
	logs := &testlog.Buffer{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	backend, err := kafkadlq.New(kafkadlq.Config{Brokers: b.Addrs(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(backend.Close)
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: dlq.NewStore(s.Pool, s.Name), Backend: backend, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	cfg := console.Config{Source: svc, Token: tok, Logger: log, KeyOrder: s.Pool, KeyOrderSchema: s.Name}
	if more != nil {
		more(&cfg)
	}
	con, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(con.Handler())
	t.Cleanup(func() { srv.Close(); con.Close() })
	return &bundle{ctx: ctx, schema: s, client: cl, adm: kadm.NewClient(cl), svc: svc, con: con, srv: srv, logs: logs, brokers: b.Addrs()}
}

// produceDead writes n dead letters of comandes with reason to the DLQ and
// syncs the index.
func (b *bundle) produceDead(t *testing.T, n int, reason string) []string {
	t.Helper()
	return b.produceDeadAt(t, n, reason, time.Now())
}

// produceDeadAt is produceDead of letters dead at now.
func (b *bundle) produceDeadAt(t *testing.T, n int, reason string, now time.Time) []string {
	t.Helper()
	return b.produceDeadBy(t, n, reason, now, "repartiment")
}

// produceDeadBy is produceDeadAt of letters that consumer group dead-lettered.
func (b *bundle) produceDeadBy(t *testing.T, n int, reason string, now time.Time, group string) []string {
	t.Helper()
	var ids []string
	for i := 0; i < n; i++ {
		ids = append(ids, b.deadLetter(t, uuid.NewString(), i, reason, now, group))
	}
	if _, err := b.svc.Sync(b.ctx); err != nil {
		t.Fatalf("sync: %v", err)
	}
	return ids
}

// deadLetter writes the dead letter of event eid (order P-2026-<100+i>),
// dead at now in consumer group with reason, to the DLQ, without syncing
// the index, and returns its id. Two calls with one eid and group write two
// copies of one letter.
func (b *bundle) deadLetter(t *testing.T, eid string, i int, reason string, now time.Time, group string) string {
	t.Helper()
	e := &envelope.Envelope{ID: eid, Type: "comanda.creada", Version: 1, TimeMS: now.UnixMilli(), Origin: "comandes",
		Data: json.RawMessage(`{"id":"P-2026-` + strconv.Itoa(100+i) + `","client":"` + customer + `","mercat":"girona","linies":[]}`)}
	val, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	ts := strconv.FormatFloat(float64(now.UnixMicro())/1e6, 'f', 6, 64)
	r := &kgo.Record{Topic: comandesDLQ, Key: []byte("P-2026-" + strconv.Itoa(100+i)), Value: val, Timestamp: now, Headers: []kgo.RecordHeader{
		{Key: "intents", Value: []byte("3")}, {Key: "motiu", Value: []byte(reason)},
		{Key: "topic_original", Value: []byte(comandes)}, {Key: "particio_original", Value: []byte("0")},
		{Key: "offset_original", Value: []byte(strconv.Itoa(i))}, {Key: "primera_fallada", Value: []byte(ts)},
		{Key: "grup_consumidor", Value: []byte(group)}, {Key: "tipus", Value: []byte("comanda.creada")},
		{Key: "id_esdeveniment", Value: []byte(eid)},
	}}
	if err := b.client.ProduceSync(b.ctx, r).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
	return dlq.KafkaID(r.Topic, r.Partition, r.Offset)
}

// pending counts the index's pending letters.
func (b *bundle) pending(t *testing.T) int {
	t.Helper()
	var n int
	if err := b.schema.Pool.QueryRow(b.ctx, "SELECT count(*) FROM cartes_mortes WHERE estat = 'pendent'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// records is the number of records on topic.
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

// browser is an HTTP client with cookies that does not follow redirects.
type browser struct {
	t  *testing.T
	c  *http.Client
	ba string
}

func (b *bundle) browser(t *testing.T) *browser {
	jar, _ := cookiejar.New(nil)
	return &browser{t: t, ba: b.srv.URL, c: &http.Client{Jar: jar, Timeout: 30 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

func (br *browser) do(method, path string, form url.Values, hdr ...string) (*http.Response, string) {
	br.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, br.ba+path, body)
	if err != nil {
		br.t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := br.c.Do(req)
	if err != nil {
		br.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func (br *browser) get(path string) (*http.Response, string) { return br.do(http.MethodGet, path, nil) }
func (br *browser) post(path string, form url.Values) (*http.Response, string) {
	return br.do(http.MethodPost, path, form)
}

// waitJob follows the replay job at loc (a /feina?id= address) through
// /feina.json until it no longer runs, and returns its last status.
func (br *browser) waitJob(loc string) console.JobStatus {
	br.t.Helper()
	var st console.JobStatus
	testkit.Eventually(br.t, 60*time.Second, "the replay job", func() bool {
		_, body := br.get(strings.Replace(loc, "/feina?", "/feina.json?", 1))
		if err := json.Unmarshal([]byte(body), &st); err != nil {
			br.t.Fatalf("job status: %v: %s", err, body)
		}
		return st.State != "running"
	})
	return st
}

// login logs in and returns the CSRF token of the session.
func (br *browser) login(tok string) string {
	br.t.Helper()
	resp, body := br.post("/login", url.Values{"token": {tok}, "next": {"/"}})
	if resp.StatusCode != http.StatusSeeOther {
		br.t.Fatalf("login: %d %s", resp.StatusCode, body)
	}
	_, page := br.get("/")
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(page)
	if m == nil {
		br.t.Fatalf("no csrf token on the page after login")
	}
	return m[1]
}

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))

// planOf is the plan token (form field pla) a dry run or purge confirmation
// page binds its confirmation to.
func planOf(t *testing.T, body string) string {
	t.Helper()
	m := regexp.MustCompile(`name="pla" value="([^"]+)"`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("the page binds no plan to its confirmation:\n%s", body)
	}
	return m[1]
}
