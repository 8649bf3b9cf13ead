package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/consolesrv"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
)

// lagGroup is a consumer group of the system (inventari's), foreignGroup
// one of another Kafka client.
const lagGroup, foreignGroup = "inventari.descompte_estoc", "intrus"

// lagFixture: a broker where the system's group lagGroup is 4 records behind
// on comandes.esdeveniments and foreignGroup, a plain kgo consumer of
// another client, 3 behind; and an outbox with 2 pending rows.
func lagFixture(t *testing.T) (brokers string, s *pgtest.Schema) {
	t.Helper()
	b := kafkatest.New(t, "comandes.esdeveniments")
	cl := kafkatest.Client(t, b, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	ctx := context.Background()
	for i := 0; i < 4; i++ {
		if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "comandes.esdeveniments", Partition: 2, Value: []byte("x")}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	var o kadm.Offsets
	o.Add(kadm.Offset{Topic: "comandes.esdeveniments", Partition: 2, At: 0, LeaderEpoch: -1})
	if resp, err := kadm.NewClient(cl).CommitOffsets(ctx, lagGroup, o); err != nil || resp.Error() != nil {
		t.Fatalf("commit: %v %v", err, resp.Error())
	}
	commitForeign(t, b.Addrs(), "comandes.esdeveniments")
	s = pgtest.NewMigratedSchema(t)
	ob := outbox.New(outbox.Config{Names: s.Names()})
	for i := 0; i < 2; i++ {
		if err := ob.Enqueue(ctx, s.Pool, &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: map[string]any{"i": i}}); err != nil {
			t.Fatal(err)
		}
	}
	return strings.Join(b.Addrs(), ","), s
}

// commitForeign joins foreignGroup on topic as any Kafka client would,
// commits the first record it reads, and leaves.
func commitForeign(t *testing.T, brokers []string, topic string) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumerGroup(foreignGroup), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.DisableAutoCommit())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		fs := cl.PollRecords(ctx, 1)
		if ctx.Err() != nil {
			t.Fatalf("group %s read nothing: %v", foreignGroup, fs.Err0())
		}
		if recs := fs.Records(); len(recs) > 0 {
			if err := cl.CommitRecords(ctx, recs[0]); err != nil {
				t.Fatalf("group %s commit: %v", foreignGroup, err)
			}
			return
		}
	}
}

// groupNames lists the groups of snap.
func groupNames(snap *lag.Snapshot) []string {
	var out []string
	for _, g := range snap.Groups {
		out = append(out, g.Group)
	}
	return out
}

func TestLagCommand(t *testing.T) {
	t.Parallel()
	brokers, s := lagFixture(t)
	base := []string{"--brokers", brokers, "--outbox", "comandes=" + s.URL, "--outbox-schema", s.Name}
	run := func(args ...string) (string, string, error) {
		var out, errOut bytes.Buffer
		err := lagCmd(context.Background(), &out, &errOut, append(append([]string{}, base...), args...))
		return out.String(), errOut.String(), err
	}
	out, _, err := run("--json")
	var snap lag.Snapshot
	if err != nil || json.Unmarshal([]byte(out), &snap) != nil {
		t.Fatalf("km0 lag --json: %v\n%s", err, out)
	}
	// By default only the system's groups: lagGroup (listed), not the
	// foreign one, nor the system's groups the cluster does not list.
	if len(snap.Outboxes) != 1 || snap.Outboxes[0].Pending != 2 || len(snap.Groups) != 1 || snap.Groups[0].Group != lagGroup || snap.Groups[0].Total != 4 {
		t.Fatalf("snapshot: outboxes %+v, groups %v", snap.Outboxes, groupNames(&snap))
	}
	// One line per group by default; its partitions with --partitions.
	out, _, err = run()
	if err != nil || !strings.Contains(out, "OUTBOX") || !regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(lagGroup)+`\s+\S+\s+\d+\s+\d+\s+4\s`).MatchString(out) ||
		strings.Contains(out, "comandes.esdeveniments") || strings.Contains(out, foreignGroup) {
		t.Fatalf("km0 lag: %v\n%s", err, out)
	}
	out, _, err = run("--partitions")
	if err != nil || !strings.Contains(out, lagGroup+"  ") || !strings.Contains(out, "comandes.esdeveniments") || !strings.Contains(out, "total (") {
		t.Fatalf("km0 lag --partitions: %v\n%s", err, out)
	}
	// --all-groups: the foreign group too, marked.
	out, _, err = run("--json", "--all-groups")
	snap = lag.Snapshot{}
	if err != nil || json.Unmarshal([]byte(out), &snap) != nil {
		t.Fatalf("km0 lag --json --all-groups: %v\n%s", err, out)
	}
	if len(snap.Groups) != 2 || snap.Groups[0].Group != foreignGroup || !snap.Groups[0].Foreign || snap.Groups[0].Total != 3 ||
		snap.Groups[1].Group != lagGroup || snap.Groups[1].Foreign || snap.Groups[1].Total != 4 {
		t.Fatalf("km0 lag --all-groups: groups %+v", snap.Groups)
	}
	if out, _, err = run("--all-groups"); err != nil || !strings.Contains(out, foreignGroup) {
		t.Fatalf("km0 lag --all-groups: %v\n%s", err, out)
	}
	// --consumer-groups names the system's groups instead.
	if out, _, err = run("--consumer-groups", foreignGroup); err != nil || !strings.Contains(out, foreignGroup) || strings.Contains(out, lagGroup) {
		t.Fatalf("km0 lag --consumer-groups %s: %v\n%s", foreignGroup, err, out)
	}
	_, errOut, err := run("--max-lag", "3")
	if !errors.Is(err, errOverThreshold) || !strings.Contains(errOut, "group "+lagGroup+": lag 4 > 3") || strings.Contains(errOut, "outbox comandes") {
		t.Fatalf("km0 lag --max-lag 3: %v\n%s", err, errOut)
	}
	if _, _, err := run("--max-lag", "4"); err != nil {
		t.Fatalf("km0 lag --max-lag 4 (at the threshold): %v", err)
	}
	if _, _, err := run("--max-age", "1h"); err != nil {
		t.Fatalf("km0 lag --max-age 1h: %v", err)
	}
	if _, errOut, err := run("--max-age", "1ms"); !errors.Is(err, errOverThreshold) || !strings.Contains(errOut, "outbox comandes: oldest") {
		t.Fatalf("km0 lag --max-age 1ms: %v\n%s", err, errOut)
	}
	var out2, errOut2 bytes.Buffer
	if err := lagCmd(context.Background(), &out2, &errOut2, []string{"--brokers", ""}); err == nil || !strings.Contains(err.Error(), "nothing to measure") {
		t.Fatalf("km0 lag with nothing to measure: %v", err)
	}
}

// The console's server: the page, and /metrics with the consumer-group and
// outbox lag; another Host gets 421.
func TestServeConsole(t *testing.T) {
	t.Parallel()
	brokers, s := lagFixture(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var printed bytes.Buffer
	url, stop, err := consolesrv.Serve(ctx, consolesrv.Parts{Addr: "127.0.0.1:0", Token: "t0k3n", Broker: "Kafka",
		Lag:      consolesrv.LagTargets{Brokers: strings.Split(brokers, ","), Config: lag.Config{Groups: []string{lagGroup}, Outboxes: []lag.Outbox{{Name: "comandes", DB: s.Pool, Names: s.Names()}}, Logger: cli.Logger()}},
		Interval: time.Hour, Out: &printed, Name: "km0 console"})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if !strings.Contains(printed.String(), url+"/") {
		t.Fatalf("the console's URL is not printed: %q", printed.String())
	}
	get := func(path, host string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, url+path, nil)
		if host != "" {
			req.Host = host
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	var metrics string
	testkit.Eventuallyf(t, 30*time.Second, "the group lag on /metrics", func() (bool, string) {
		_, metrics = get("/metrics", "")
		return strings.Contains(metrics, `km0_consumer_group_lag{grup="`+lagGroup+`",particio="2",topic="comandes.esdeveniments"} 4`), metrics
	})
	if !strings.Contains(metrics, `km0_outbox_pending_rows{outbox="comandes"} 2`) {
		t.Fatalf("no outbox lag on /metrics:\n%s", metrics)
	}
	if code, body := get("/lag", ""); code != 200 || !strings.Contains(body, `id="lag-chart"`) || !strings.Contains(body, lagGroup) {
		t.Fatalf("GET /lag: %d\n%s", code, body)
	}
	// The foreign group is measured but shown only on request, and never
	// in the metrics (nor the alerts) without --all-groups.
	if strings.Contains(metrics, foreignGroup) {
		t.Fatalf("/metrics shows the foreign group:\n%s", metrics)
	}
	if _, body := get("/lag", ""); strings.Contains(body, foreignGroup) || !strings.Contains(body, `href="/lag?groups=all"`) {
		t.Fatalf("GET /lag shows the foreign group, or no link to it:\n%s", body)
	}
	if _, body := get("/lag?groups=all", ""); !strings.Contains(body, foreignGroup) {
		t.Fatalf("GET /lag?groups=all lacks the foreign group:\n%s", body)
	}
	lagJSON := func(path string) []string {
		_, body := get(path, "")
		var v struct {
			Latest  lag.Snapshot `json:"ultima"`
			History []lag.Point  `json:"historia"`
		}
		if err := json.Unmarshal([]byte(body), &v); err != nil || len(v.History) == 0 {
			t.Fatalf("GET %s: %v\n%s", path, err, body)
		}
		names := groupNames(&v.Latest)
		for g := range v.History[len(v.History)-1].Others {
			names = append(names, "history:"+g)
		}
		return names
	}
	if got := lagJSON("/lag.json"); strings.Join(got, ",") != lagGroup {
		t.Fatalf("GET /lag.json: groups %v, want only %s", got, lagGroup)
	}
	if got := lagJSON("/lag.json?groups=all"); strings.Join(got, ",") != foreignGroup+","+lagGroup+",history:"+foreignGroup {
		t.Fatalf("GET /lag.json?groups=all: groups %v, want %s and %s", got, foreignGroup, lagGroup)
	}
	if code, _ := get("/", "evil.example"); code != http.StatusMisdirectedRequest {
		t.Fatalf("GET / with another Host: %d, want 421", code)
	}
}

// syncBuffer is a bytes.Buffer safe for a writer and a reader goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// km0 console indexes new dead letters by itself (it replaces km0 dlq
// index): one written to the DLQ after it started shows up in its overview
// and its metrics, and it stops cleanly with its context. Its /dlq/ API
// needs the token, and shares the login's attempt budget: wrong bearer
// tokens there throttle a login from the same address.
//
// Not parallel: t.Setenv, for the environment the console (its admin token)
// reads in this process.
func TestConsoleCommandIndexesAndServes(t *testing.T) {
	h := newDLQHarness(t)
	t.Setenv(dlqcli.AdminTokenEnv, "t0k3n-of-the-console")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- consoleCmd(ctx, &out, &errOut, append(append([]string{}, h.base...), "--http-addr", "127.0.0.1:0", "--lag-interval", "1h"))
	}()
	urlRE := regexp.MustCompile(`console at (http://[0-9.:]+)/`)
	var base string
	testkit.Eventually(t, 30*time.Second, "the console's URL", func() bool {
		if m := urlRE.FindStringSubmatch(errOut.String()); m != nil {
			base = m[1]
		}
		return base != ""
	})

	h.dead("P-9", "permanent: esquema: falta client", []byte(`{}`))
	get := func(path string) string {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	testkit.Eventually(t, 30*time.Second, "the letter in the console", func() bool {
		return strings.Contains(get("/"), `<td class="num count">1</td>`)
	})

	if m := get("/metrics"); !strings.Contains(m, `km0_dlq_letters_total{motiu="permanent: esquema",topic="comandes.esdeveniments"} 1`) {
		t.Fatalf("no dead-letter counter on /metrics:\n%s", m)
	}
	api := func(tok string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, base+"/dlq/letters?motiu=permanent", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := api("t0k3n-of-the-console"); code != http.StatusOK || !strings.Contains(body, "falta client") {
		t.Fatalf("GET /dlq/letters with the token: %d %s", code, body)
	}
	for i := range dlq.GatePerSourceDefault {
		if code, body := api("guess"); code != http.StatusUnauthorized || strings.Contains(body, "falta client") {
			t.Fatalf("GET /dlq/letters with wrong token %d: %d %s, want 401", i, code, body)
		}
	}
	resp, err := http.PostForm(base+"/login", url.Values{"token": {"t0k3n-of-the-console"}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("login after the API's budget of wrong tokens from this address: %d, want 429 (one budget)", resp.StatusCode)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("km0 console: %v\n%s", err, errOut.String())
	}
}

// km0 lag --max-lag 0 means "fully caught up": the process exits 1 while a
// group has lag 4; without the flag (off) it exits 0; --max-age 0 is a
// threshold as well. The exit status of the binary, as a script sees it.
func TestLagMaxLagZeroExitStatus(t *testing.T) {
	t.Parallel()
	brokers, s := lagFixture(t)
	exit := func(args ...string) (int, string) {
		t.Helper()
		cmd := exec.Command(km0Bin(t), append([]string{"lag", "--brokers", brokers, "--outbox", "comandes=" + s.URL, "--outbox-schema", s.Name}, args...)...)
		cmd.Env = append(os.Environ(), runMainEnv+"=1", outboxesEnv+"=")
		var errOut bytes.Buffer
		cmd.Stderr = &errOut
		err := cmd.Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode(), errOut.String()
		}
		if err != nil {
			t.Fatalf("km0 lag %v: %v", args, err)
		}
		return 0, errOut.String()
	}
	if code, errOut := exit(); code != 0 {
		t.Fatalf("km0 lag (no threshold): exit %d, want 0\n%s", code, errOut)
	}
	if code, errOut := exit("--max-lag", "0"); code != 1 || !strings.Contains(errOut, "group "+lagGroup+": lag 4 > 0") || !strings.Contains(errOut, "outbox comandes: lag 2 > 0") {
		t.Fatalf("km0 lag --max-lag 0 with lag 4: exit %d, want 1\n%s", code, errOut)
	}
	if code, errOut := exit("--max-age", "0s"); code != 1 || !strings.Contains(errOut, "outbox comandes: oldest") {
		t.Fatalf("km0 lag --max-age 0s: exit %d, want 1\n%s", code, errOut)
	}
	if code, errOut := exit("--max-lag", "-1"); code != 2 {
		t.Fatalf("km0 lag --max-lag -1: exit %d, want 2 (usage)\n%s", code, errOut)
	}
}

// km0 console (and km0 lag) start when an --outbox database does not exist
// yet: that outbox is an error of each sample, and once the database is
// there (created, migrated) the next sample measures it.
func TestConsoleStartsWithAnOutboxDatabaseMissing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := "km0t_absent_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	u, err := url.Parse(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	admin, err := pgxpool.New(ctx, pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)") })
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	lf := addLagFlags(fs, true)
	if err := fs.Parse([]string{"--outbox", "comandes=" + u.String()}); err != nil {
		t.Fatal(err)
	}
	cfg, closeLag, err := lagConfig(ctx, "", "", nil, nil, kafkadlq.GroupDefault, lf)
	if err != nil {
		t.Fatalf("an outbox database that does not exist yet stopped the start: %v", err)
	}
	defer closeLag()
	m, err := cfg.Measurer()
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	snap, err := m.Measure(ctx)
	if err != nil || len(snap.Outboxes) != 1 || snap.Outboxes[0].Err == "" || strings.Contains(snap.Outboxes[0].Err, "postgres://") {
		t.Fatalf("first sample: %v %+v", err, snap)
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	db, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	_, err = migrate.Up(ctx, db, migrate.Names{}, migrate.Outbox)
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
	snap, err = m.Measure(ctx)
	if err != nil || len(snap.Outboxes) != 1 || snap.Outboxes[0].Err != "" || snap.Outboxes[0].Pending != 0 {
		t.Fatalf("sample once the database exists: %v %+v", err, snap.Outboxes)
	}
}

// km0 console --service-db: each service's database with its consumer
// groups (as $KM0_GROUPS renames them), opened without connecting; a
// malformed URL is refused without showing it.
//
// Not parallel: t.Setenv, for the environment serviceDatabases ($KM0_GROUPS)
// reads in this process.
func TestServiceDatabases(t *testing.T) {
	t.Setenv("KM0_GROUPS", "comandes.refus_estoc=c-refus")
	m := &mapFlag{secret: true, name: "service-db"}
	for _, v := range []string{"comandes=postgres://u:pw@127.0.0.1:1/km0_comandes", "cataleg=postgres://u:pw@127.0.0.1:1/km0_cataleg"} {
		if err := m.Set(v); err != nil {
			t.Fatal(err)
		}
	}
	sdbs, closeAll, err := serviceDatabases(m)
	if err != nil {
		t.Fatal(err)
	}
	defer closeAll()
	if len(sdbs) != 2 || sdbs[0].Name != "comandes" || !slices.Equal(sdbs[0].Groups, []string{"comandes.confirmacio_pagament", "c-refus", "comandes.repartiment"}) ||
		!slices.Equal(sdbs[1].Groups, []string{"cataleg.estoc_baix"}) {
		t.Fatalf("service databases: %+v", sdbs)
	}
	bad := &mapFlag{secret: true, name: "service-db"}
	_ = bad.Set("x=postgres://u:pw@h:notaport/db")
	if _, _, err := serviceDatabases(bad); err == nil || strings.Contains(err.Error(), "pw") {
		t.Fatalf("malformed --service-db: %v", err)
	}
}
