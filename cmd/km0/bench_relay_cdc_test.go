package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/pgtest"
)

// `km0 bench relay --mode cdc` refuses the flags of the other mode and an
// unknown mode before it connects anywhere.
func TestBenchRelayRefusesBadModeFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--mode", "wal"}, `--mode "wal"`},
		{[]string{"--mode", "cdc", "--baseline"}, "--mode polling only"},
		{[]string{"--mode", "cdc", "--latency-rate", "-1"}, "--latency-rate"},
	} {
		err := benchRelay(context.Background(), append([]string{"--database-url", "postgres://nobody@127.0.0.1:1/x"}, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("km0 bench relay %v: %v, want an error with %q", c.args, err, c.want)
		}
	}
}

// `km0 bench relay --mode cdc` end to end with tiny numbers, as a process:
// the machine's server is not logical, so it runs on a private cluster; it
// prints a line per relay and round, the side-by-side line and both
// latency lines, every count as asked. It keeps the harness from rotting;
// it measures nothing.
func TestBenchRelayCDCModeEndToEnd(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "bench", "relay", "--mode", "cdc", "--database-url", pgtest.URL(),
		"--n", "2000", "--rounds", "2", "--latency-rate", "200", "--latency-seconds", "0.5")
	cmd.Env = append(os.Environ(), envRunMain+"=1")
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("km0 bench relay --mode cdc: %v\n%s", err, stderr.String())
	}
	seen := map[string]int{}
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("not a JSON line: %q", sc.Text())
		}
		b, _ := m["bench"].(string)
		seen[b]++
		switch b {
		case benchCDC, benchPolling:
			if m["events"] != float64(2000) || m["records"].(float64) < 2000 {
				t.Fatalf("line %v", m)
			}
		case "latency_cdc", "latency_polling":
			if m["events"] != float64(100) {
				t.Fatalf("line %v", m)
			}
		}
	}
	for b, want := range map[string]int{benchCDC: 2, benchPolling: 2, "relay_cdc_vs_polling": 1, "latency_cdc": 2,
		"latency_polling": 2, "latency_cdc_vs_polling": 1} {
		if seen[b] != want {
			t.Fatalf("%d %q lines, want %d; output:\n%s", seen[b], b, want, out.String())
		}
	}
}

// `km0 bench relay --mode cdc` on a given server of this machine (here the
// shared one; with wal_level = logical the bench runs on it directly)
// measures the server's CPU from /proc, so server_cpu_us_per_event is
// printed, not only on the private cluster; a server it cannot see gets
// server_cpu_us_per_event null with the reason, never a silent absence.
func TestBenchServerCPUIsMeasuredOnAGivenLocalServer(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t, pgtest.URL(), 2)
	m := newServerMeter(ctx, nil, pool)
	if !m.measured() {
		t.Fatalf("the local server's postmaster was not found: %s", m.describe())
	}
	m.start()
	if _, err := pool.Exec(ctx, "SELECT count(*) FROM generate_series(1, 3000000)"); err != nil {
		t.Fatal(err)
	}
	cpu, byProc := m.stop(ctx)
	res := map[string]any{}
	m.put(res, cpu, byProc, 1000)
	if v, ok := res["server_cpu_us_per_event"].(float64); !ok || v <= 0 {
		t.Fatalf("server_cpu_us_per_event %v (cpu %v), want a positive figure", res["server_cpu_us_per_event"], cpu)
	}
	remote := &serverMeter{}
	res = map[string]any{}
	remote.put(res, 0, nil, 1000)
	if v, ok := res["server_cpu_us_per_event"]; !ok || v != nil || !strings.Contains(res["server_cpu"].(string), "not measured") {
		t.Fatalf("unmeasured server: %v, want server_cpu_us_per_event null and the reason", res)
	}
}

// `km0 bench relay --mode cdc --outbox wal` with tiny numbers, as a
// process: a line per side (wal, cdc, polling, the seed's port) and round, then the
// side-by-side line with the ratios; the WAL side leaves no outbox row;
// then a latency line per side (commit → consumer commit, 100 events each)
// and theirs side by side. It
// keeps the harness from rotting; it measures nothing.
func TestBenchRelayWALSidesEndToEnd(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "bench", "relay", "--mode", "cdc", "--outbox", "wal", "--database-url", pgtest.URL(),
		"--n", "800", "--rounds", "1", "--latency-rate", "200", "--latency-seconds", "0.5")
	cmd.Env = append(os.Environ(), envRunMain+"=1")
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("km0 bench relay --mode cdc --outbox wal: %v\n%s", err, stderr.String())
	}
	seen := map[string]map[string]any{}
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("not a JSON line: %q", sc.Text())
		}
		b, _ := m["bench"].(string)
		seen[b] = m
	}
	for _, b := range []string{benchWAL, benchCDC, benchPolling, benchSeedPort} {
		if seen[b] == nil || seen[b]["records"].(float64) < 800 {
			t.Fatalf("%s line %v; output:\n%s", b, seen[b], out.String())
		}
	}
	if seen[benchWAL]["outbox_rows"] != float64(0) || seen[benchPolling]["outbox_rows"] != float64(800) {
		t.Fatalf("outbox rows: wal %v (want 0), polling %v (want 800)", seen[benchWAL]["outbox_rows"], seen[benchPolling]["outbox_rows"])
	}
	for _, b := range []string{"latency_wal", "latency_cdc", "latency_polling", "latency_seed_port"} {
		if seen[b] == nil || seen[b]["events"] != float64(100) || seen[b]["p99_ms"] == nil {
			t.Fatalf("%s line %v; output:\n%s", b, seen[b], out.String())
		}
	}
	if lat := seen["latency_wal_vs_cdc_vs_polling"]; lat == nil || lat["wal_p50_ms"] == nil || lat["polling_p99_ms"] == nil {
		t.Fatalf("latency summary %v; output:\n%s", lat, out.String())
	}
	sum := seen["relay_wal_vs_cdc_vs_polling"]
	for _, k := range []string{"wal_vs_polling", "wal_vs_cdc", "wal_writers_vs_table", "wal_server_cpu_vs_polling", "wal_vs_seed_port"} {
		if _, ok := sum[k].(float64); !ok {
			t.Fatalf("summary lacks %s: %v", k, sum)
		}
	}
}
