package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

type dlqHarness struct {
	t      *testing.T
	broker *kafkaembed.Broker
	base   []string
	cl     *kgo.Client
	schema *pgtest.Schema
}

func newDLQHarness(t *testing.T) *dlqHarness {
	s := pgtest.NewSchema(t)
	b := kafkatest.New(t, "comandes.esdeveniments", "comandes.esdeveniments.dlq")
	return &dlqHarness{t: t, broker: b, cl: kafkatest.Client(t, b), schema: s,
		base: []string{"--database-url", s.URL, "--schema", s.Name, "--brokers", strings.Join(b.Addrs(), ",")}}
}

// run runs `km0 dlq <args>` with the harness's connection flags and stdin.
func (h *dlqHarness) run(stdin string, tty bool, args ...string) (string, error) {
	var out, errOut bytes.Buffer
	c := &dlqcli.CLI{Out: &out, ErrOut: &errOut, In: strings.NewReader(stdin), TTY: tty, Now: time.Now}
	full := append([]string{args[0]}, h.base...)
	full = append(full, args[1:]...)
	err := c.Run(context.Background(), full)
	return out.String() + errOut.String(), err
}

func (h *dlqHarness) dead(key, reason string, value []byte, headers ...string) string {
	h.t.Helper()
	hs := []kgo.RecordHeader{{Key: "intents", Value: []byte("1")}, {Key: "motiu", Value: []byte(reason)},
		{Key: "topic_original", Value: []byte("comandes.esdeveniments")}}
	for i := 0; i+1 < len(headers); i += 2 {
		hs = append(hs, kgo.RecordHeader{Key: headers[i], Value: []byte(headers[i+1])})
	}
	r := &kgo.Record{Topic: "comandes.esdeveniments.dlq", Key: []byte(key), Value: value, Headers: hs}
	if err := h.cl.ProduceSync(context.Background(), r).FirstErr(); err != nil {
		h.t.Fatal(err)
	}
	return dlq.KafkaID(r.Topic, r.Partition, r.Offset)
}

func TestDLQCommands(t *testing.T) {
	t.Parallel()
	h := newDLQHarness(t)
	good := `{"id_esdeveniment":"e-1","tipus":"comanda.creada","versio":1,"data_ms":` +
		jsonNumber(time.Now().UnixMilli()) + `,"origen":"comandes","dades":{"id":"P-1"}}`
	h.dead("P-1", "permanent: esquema: adreca_lliurament absent", []byte(good), "tipus", "comanda.creada", "id_esdeveniment", "e-1")
	poison := h.dead("P-2", "permanent: envelope: malformed JSON", []byte("{\"x\": \x1b[2J\xff"))

	out, err := h.run("", false, "ls")
	if err != nil || !strings.Contains(out, "2 dead letter(s)") || !strings.Contains(out, "permanent: esquema") ||
		!strings.Contains(out, "permanent: envelope") {
		t.Fatalf("ls: %v\n%s", err, out)
	}
	out, err = h.run("", false, "ls", "--json", "--reason", "permanent: esquema")
	var ls struct {
		Groups  []dlq.Group      `json:"grups"`
		Letters []dlq.LetterView `json:"cartes"`
	}
	if err != nil || json.Unmarshal([]byte(out), &ls) != nil || len(ls.Letters) != 1 || ls.Letters[0].EventID != "e-1" {
		t.Fatalf("ls --json: %v\n%s", err, out)
	}

	out, err = h.run("", false, "show", poison, "--json")
	if err != nil || !strings.Contains(out, `"valor_base64"`) {
		t.Fatalf("show --json: %v\n%s", err, out)
	}
	out, err = h.run("", false, "show", poison)
	if err != nil || strings.ContainsAny(out, "\x1b\xff") || !strings.Contains(out, `\x1b[2J\xff`) ||
		!strings.Contains(out, "not JSON") {
		t.Fatalf("show of a poison letter is unsafe or wrong: %v\n%q", err, out)
	}

	// Purge needs a confirmation: refused without --yes off a terminal,
	// cancelled by "n", done by "y".
	if _, err := h.run("", false, "purge", "--id", poison); err == nil || !strings.Contains(err.Error(), "--yes") {
		t.Fatalf("purge without --yes off a terminal: %v", err)
	}
	if _, err := h.run("", true, "purge", "--id", poison); err == nil || !strings.Contains(err.Error(), "--yes") {
		t.Fatalf("purge on a terminal-like stdin that is empty (/dev/null): %v", err)
	}
	if _, err := h.run("n\n", true, "purge", "--id", poison); err == nil || !strings.Contains(err.Error(), "cancelled") {
		t.Fatalf("purge answered n: %v", err)
	}
	out, _ = h.run("", false, "ls", "--json")
	if json.Unmarshal([]byte(out), &ls) != nil || len(ls.Letters) != 2 {
		t.Fatalf("a refused purge changed something:\n%s", out)
	}
	if out, err := h.run("y\n", true, "purge", "--id", poison); err != nil || !strings.Contains(out, "1 letter(s) marked purged") ||
		!strings.Contains(out, "Kafka cannot delete single records") {
		t.Fatalf("purge answered y: %v\n%s", err, out)
	}

	out, err = h.run("", false, "replay", "--dry-run", "--all")
	if err != nil || !strings.Contains(out, "1 selected, 1 would replay, 0 refused") {
		t.Fatalf("replay --dry-run: %v\n%s", err, out)
	}
	if out, err := h.run("", false, "replay", "--reason", "permanent: esquema"); err != nil || !strings.Contains(out, "1 replayed") {
		t.Fatalf("replay: %v\n%s", err, out)
	}
	if out, err := h.run("", false, "replay", "--id", poison); err == nil || !strings.Contains(out, "refused") {
		t.Fatalf("replay of a purged letter without --force: %v\n%s", err, out)
	}
}

func TestDLQHelpAndUsage(t *testing.T) {
	t.Parallel()
	c := &dlqcli.CLI{Out: &bytes.Buffer{}, ErrOut: &bytes.Buffer{}, In: strings.NewReader(""), Now: time.Now}
	for _, sub := range []string{"ls", "show", "replay", "purge", "index"} {
		if err := c.Run(context.Background(), []string{sub, "--help"}); !errors.Is(err, flag.ErrHelp) {
			t.Errorf("km0 dlq %s --help: %v, want flag.ErrHelp", sub, err)
		}
	}
	if err := c.Run(context.Background(), []string{"help"}); err != nil {
		t.Errorf("km0 dlq help: %v", err)
	}
	for _, bad := range [][]string{{}, {"nope"}, {"ls", "--bogus"}, {"show", "--brokers", "x", "--database-url", "y"}} {
		if err := c.Run(context.Background(), bad); !errors.Is(err, cli.ErrUsage) {
			t.Errorf("km0 dlq %v: %v, want a usage error", bad, err)
		}
	}
	err := c.Run(context.Background(), []string{"ls", "--brokers", ""})
	if err == nil || !strings.Contains(err.Error(), "KM0_KAFKA_BROKERS") {
		t.Errorf("missing brokers: %v", err)
	}
}

func jsonNumber(n int64) string { b, _ := json.Marshal(n); return string(b) }

// The y/N question of purge counts the letters it would purge; counting
// must not load them (200 letters of 256 KiB = 50 MiB of values; the whole
// command, answered n, may allocate at most a fifth of that).
//
// Not parallel: it measures the allocations of the whole test binary
// (runtime.MemStats), which parallel tests would add to.
func TestDLQPurgeQuestionDoesNotLoadTheLetters(t *testing.T) {
	h := newDLQHarness(t)
	if out, err := h.run("", false, "ls"); err != nil { // creates the index
		t.Fatalf("ls: %v\n%s", err, out)
	}
	value := bytes.Repeat([]byte("x"), 256<<10)
	store := dlq.NewStore(h.schema.Pool, h.schema.Name)
	for i := range 200 {
		l := dlq.NewLetter("comandes.esdeveniments.dlq", 0, int64(i), time.Now(), &transport.Message{Value: value,
			Headers: []transport.Header{{Key: contract.HeaderReason, Value: "permanent: esquema: x"}}})
		if _, err := store.Insert(context.Background(), []*dlq.Letter{l}); err != nil {
			t.Fatal(err)
		}
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	out, err := h.run("n\n", true, "purge", "--reason", "permanent: esquema")
	runtime.ReadMemStats(&after)
	if err == nil || !strings.Contains(out, "Purge 200 dead letter(s)?") {
		t.Fatalf("purge answered n: %v\n%s", err, out)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 10<<20 {
		t.Fatalf("asking to purge 200 letters allocated %d MiB, more than a fifth of their 50 MiB of values", alloc>>20)
	}
}

// replay and purge without any filter refuse, naming --all, before they
// connect to anything; --all with a filter is refused as ambiguous.
func TestDLQReplayAndPurgeNeedAnExplicitAll(t *testing.T) {
	t.Parallel()
	c := &dlqcli.CLI{Out: &bytes.Buffer{}, ErrOut: &bytes.Buffer{}, In: strings.NewReader(""), Now: time.Now}
	conn := []string{"--brokers", "127.0.0.1:1", "--database-url", "postgres://nobody@127.0.0.1:1/none"}
	for _, args := range [][]string{{"replay"}, {"replay", "--dry-run"}, {"purge", "--yes"}, {"purge", "--yes", "--delete-records"}} {
		err := c.Run(context.Background(), append(args, conn...))
		if err == nil || !strings.Contains(err.Error(), "--all") || !strings.Contains(err.Error(), "refusing") {
			t.Errorf("km0 dlq %v without a filter: %v, want a refusal naming --all", args, err)
		}
	}
	for _, args := range [][]string{{"replay", "--all", "--reason", "x"}, {"purge", "--all", "--id", "a.dlq/0/1", "--yes"}} {
		err := c.Run(context.Background(), append(args, conn...))
		if err == nil || !strings.Contains(err.Error(), "--all selects every letter") {
			t.Errorf("km0 dlq %v: %v, want a refusal of --all with a filter", args, err)
		}
	}
}

// km0 dlq index --http-addr checks the Host header as the other servers do
// (a DNS-rebinding page sends Host: attacker.example: 421, nothing of the
// letter, even with the right token), and its /dlq/ API needs the token.
//
// Not parallel: t.Setenv, for the environment km0 dlq index (its admin token)
// reads in this process.
func TestDLQIndexHTTPChecksTheHostAndTheToken(t *testing.T) {
	h := newDLQHarness(t)
	id := h.dead("P-7", "permanent: esquema: DNI 12345678Z", []byte(`{}`))
	t.Setenv(dlqcli.AdminTokenEnv, "t0k3n-of-the-index")
	addr := freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan error, 1)
	go func() {
		c := &dlqcli.CLI{Out: &out, ErrOut: &errOut, In: strings.NewReader(""), Now: time.Now}
		done <- c.Run(ctx, append(append([]string{"index"}, h.base...), "--http-addr", addr))
	}()
	get := func(path, host, tok string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
		if host != "" {
			req.Host = host
		}
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	testkit.Eventually(t, 30*time.Second, "the letter in the index's API", func() bool {
		code, body := get("/dlq/letters/"+id, "", "t0k3n-of-the-index")
		return code == http.StatusOK && strings.Contains(body, "12345678Z")
	})

	for _, host := range []string{"attacker.example", "attacker.example:" + strings.Split(addr, ":")[1]} {
		for _, p := range []string{"/dlq/letters/" + id, "/dlq/letters", "/metrics"} {
			if code, body := get(p, host, "t0k3n-of-the-index"); code != http.StatusMisdirectedRequest || strings.Contains(body, "12345678Z") {
				t.Fatalf("GET %s with Host %s: %d, want 421 and nothing of the letter", p, host, code)
			}
		}
	}
	if code, body := get("/dlq/letters/"+id, "", ""); code != http.StatusUnauthorized || strings.Contains(body, "12345678Z") {
		t.Fatalf("GET a letter without the token: %d, want 401", code)
	}
	if code, _ := get("/dlq/letters/"+id, "localhost:"+strings.Split(addr, ":")[1], "t0k3n-of-the-index"); code != http.StatusOK {
		t.Fatalf("GET a letter with Host localhost: %d, want 200", code)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("km0 dlq index: %v\n%s", err, errOut.String())
	}
}
