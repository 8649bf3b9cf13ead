package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/km0/km0/internal/bench"
	"github.com/km0/km0/internal/pgtest"
)

// The bench names below are those internal/bench prints (relay_cdc.go,
// relay_wal.go): the lines a user of `km0 bench relay` reads.

// `km0 bench relay --mode cdc` end to end with tiny numbers, as a process:
// the machine's server is not logical, so it runs on a private cluster; it
// prints a line per relay and round, the side-by-side line and both
// latency lines, every count as asked. It keeps the harness from rotting;
// it measures nothing.
func TestBenchRelayCDCModeEndToEnd(t *testing.T) {
	t.Parallel()
	exe := km0Bin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "bench", "relay", "--mode", "cdc", "--database-url", pgtest.URL(),
		"--n", "2000", "--rounds", "2", "--latency-rate", "200", "--latency-seconds", "0.5")
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
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
		case "relay_cdc", "relay_polling":
			if m["events"] != float64(2000) || m["records"].(float64) < 2000 {
				t.Fatalf("line %v", m)
			}
		case "latency_cdc", "latency_polling":
			if m["events"] != float64(100) {
				t.Fatalf("line %v", m)
			}
		}
	}
	for b, want := range map[string]int{"relay_cdc": 2, "relay_polling": 2, "relay_cdc_vs_polling": 1, "latency_cdc": 2,
		"latency_polling": 2, "latency_cdc_vs_polling": 1} {
		if seen[b] != want {
			t.Fatalf("%d %q lines, want %d; output:\n%s", seen[b], b, want, out.String())
		}
	}
}

// `km0 bench relay --mode cdc --outbox wal` with tiny numbers, as a
// process: a line per side (wal, cdc, polling, the seed's port) and round, then the
// side-by-side line with the ratios; the WAL side leaves no outbox row;
// then a latency line per side (commit → consumer commit, 100 events each)
// and theirs side by side. It
// keeps the harness from rotting; it measures nothing.
func TestBenchRelayWALSidesEndToEnd(t *testing.T) {
	t.Parallel()
	exe := km0Bin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "bench", "relay", "--mode", "cdc", "--outbox", "wal", "--database-url", pgtest.URL(),
		"--n", "800", "--rounds", "1", "--latency-rate", "200", "--latency-seconds", "0.5")
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
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
	for _, b := range []string{"relay_wal", "relay_cdc", "relay_polling", "relay_seed_port"} {
		if seen[b] == nil || seen[b]["records"].(float64) < 800 {
			t.Fatalf("%s line %v; output:\n%s", b, seen[b], out.String())
		}
	}
	if seen["relay_wal"]["outbox_rows"] != float64(0) || seen["relay_polling"]["outbox_rows"] != float64(800) {
		t.Fatalf("outbox rows: wal %v (want 0), polling %v (want 800)", seen["relay_wal"]["outbox_rows"], seen["relay_polling"]["outbox_rows"])
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

// `km0 bench latency --outbox wal --relay-process` with tiny numbers, as a
// process: the WAL-mode writers, km0 relay --outbox wal as a process of its
// own (stopped at the end), km0's consumer; one line with every event
// measured, the consumer's handler before its COMMIT, and no relay pickup
// (another process's). It keeps the harness from rotting; it measures
// nothing.
func TestBenchLatencyWALRelayProcessEndToEnd(t *testing.T) {
	t.Parallel()
	exe := km0Bin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "bench", "latency", "--outbox", "wal", "--relay-process", "--database-url", pgtest.URL(),
		"--rate", "200", "--seconds", "0.5")
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("km0 bench latency --outbox wal --relay-process: %v\n%s", err, stderr.String())
	}
	var m map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(out.Bytes()), &m); err != nil {
		t.Fatalf("not one JSON line: %q", out.String())
	}
	if m["bench"] != "latency_wal_process" || m["events"] != float64(100) || m["p99_ms"] == nil || m["consumer_handle_p50_ms"] == nil ||
		m["relay_pickup_p50_ms"] != nil || m["p50_ms"].(float64) > m["p99_ms"].(float64) {
		t.Fatalf("line %v; stderr:\n%s", m, stderr.String())
	}
}

// benchCmd is `km0 bench name` as a function of its flags.
func benchCmd(name string) func(context.Context, []string) error {
	return func(ctx context.Context, args []string) error { return bench.Run(ctx, append([]string{name}, args...)) }
}
