package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
)

// The console of km0 up / km0 serve --console alerts on lag as km0 console
// does: with --max-lag 2 --alert-for 0s, a consumer group 4 records behind
// gets one "alerta" notice on the DLQ webhook.
func TestUpConsoleAlertsOnLag(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, system.DomainTopics()...)
	cl := kafkatest.Client(t, b, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	ctx := context.Background()
	// A group of the system (cataleg's, which this process does not run).
	const lagTopic, lagGroup = "gaps.lag", "cataleg.estoc_baix"
	adm := kadm.NewClient(cl)
	if _, err := adm.CreateTopic(ctx, 1, 1, nil, lagTopic); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 4; i++ {
		if err := cl.ProduceSync(ctx, &kgo.Record{Topic: lagTopic, Value: []byte("x")}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	var o kadm.Offsets
	o.Add(kadm.Offset{Topic: lagTopic, Partition: 0, At: 0, LeaderEpoch: -1})
	if resp, err := adm.CommitOffsets(ctx, lagGroup, o); err != nil || resp.Error() != nil {
		t.Fatalf("commit: %v %v", err, resp.Error())
	}
	var mu sync.Mutex
	var notices []dlq.LagNotice
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var n dlq.LagNotice
		if json.Unmarshal(body, &n) == nil && n.Avis == "lag" {
			mu.Lock()
			notices = append(notices, n)
			mu.Unlock()
		}
	}))
	defer hook.Close()
	sfx := make([]byte, 4)
	_, _ = rand.Read(sfx)
	suffix := "gaps_" + hex.EncodeToString(sfx)
	t.Cleanup(func() { _ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName("dlq", suffix)) })
	p := startKm0(t, []string{"KM0_DLQ_WEBHOOK=" + hook.URL, serviceDatabaseEnv("analitica") + "=" + pgtest.NewDatabase(t)},
		"serve", "analitica", "--brokers", strings.Join(b.Addrs(), ","), "--database-url", pgtest.URL(), "--database-suffix", suffix,
		"--console", "127.0.0.1:0", "--max-lag", "2", "--alert-for", "0s")
	p.waitRunning(t, 60*time.Second)
	var got []dlq.LagNotice
	testkit.Eventuallyf(t, 30*time.Second, "a lag alert on the webhook", func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		got = nil
		for _, n := range notices {
			if n.Objecte == "grup "+lagGroup {
				got = append(got, n)
			}
		}
		return len(got) > 0, p.log()
	})
	if len(got) != 1 || got[0].Estat != "alerta" || got[0].Lag != 4 || got[0].MaxLag != 2 {
		t.Fatalf("lag notices for %s: %+v", lagGroup, got)
	}
}

// Thresholds without a console to watch them are refused before anything
// is connected.
func TestUpRefusesLagThresholdsWithoutConsole(t *testing.T) {
	t.Parallel()
	err := runServices(context.Background(), "up", system.Services, []string{"--max-lag", "5", "--brokers", "127.0.0.1:1"})
	if err == nil || !strings.Contains(err.Error(), "--console") {
		t.Fatalf("km0 up --max-lag without --console: %v", err)
	}
}

// km0 up --console (here km0 serve --console) with no $KM0_DLQ_ADMIN_TOKEN
// makes a token for its run: it prints the path of a 0600 file that holds
// it (never the token itself), the console's /dlq/ API refuses every read
// without it and answers with it, and a clean stop removes the file.
func TestUpConsoleWithoutTokenMakesOneForTheRun(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, system.DomainTopics()...)
	sfx := make([]byte, 4)
	_, _ = rand.Read(sfx)
	suffix := "tok_" + hex.EncodeToString(sfx)
	t.Cleanup(func() { _ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName("dlq", suffix)) })
	console := freeAddr(t)
	p := startKm0(t, []string{dlqcli.AdminTokenEnv + "=", serviceDatabaseEnv("analitica") + "=" + pgtest.NewDatabase(t)},
		"serve", "analitica", "--brokers", strings.Join(b.Addrs(), ","), "--database-url", pgtest.URL(), "--database-suffix", suffix,
		"--console", console)
	p.waitRunning(t, 60*time.Second)
	var m []string
	testkit.Eventually(t, time.Minute, "the token file's path and the console's URL", func() bool {
		m = regexp.MustCompile(`admin token is in (\S+) \(mode 0600`).FindStringSubmatch(p.output())
		return m != nil && strings.Contains(p.output(), "console at http://"+console+"/")
	})

	path := m[1]
	t.Cleanup(func() { _ = os.Remove(path) }) // if the process was killed
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("token file %s: %v, mode %v; want 0600", path, err, fi)
	}
	raw, _ := os.ReadFile(path)
	tok := strings.TrimSpace(string(raw))
	if len(tok) < 40 || strings.Contains(p.output(), tok) || strings.Contains(p.log(), tok) {
		t.Fatalf("token of %d characters, printed: %v", len(tok), strings.Contains(p.output()+p.log(), tok))
	}
	get := func(auth string) int {
		req, _ := http.NewRequest(http.MethodGet, "http://"+console+"/dlq/letters", nil)
		if auth != "" {
			req.Header.Set("Authorization", "Bearer "+auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(""); code != http.StatusUnauthorized {
		t.Fatalf("GET /dlq/letters without the token: %d, want 401", code)
	}
	if code := get(tok); code != http.StatusOK {
		t.Fatalf("GET /dlq/letters with the run's token: %d, want 200", code)
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("km0 serve did not stop within 30 s of SIGTERM\n%s", p.log())
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("token file after a clean stop: %v, want removed", err)
	}
}
