package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
)

// `km0 bench system` end to end with tiny numbers: every part runs its real
// processes (km0 kafka, km0 relay, km0 serve inventari and pagaments, the
// ports), prints JSON lines whose counts match what was asked, and leaves no
// database behind. It keeps the harness from rotting; it measures nothing.
// Its km0 serve pagaments and inventari run on a vhost of the test's own
// (amqptest.VHost): pagaments.autoritzacions and inventari.reserves are fixed
// names, which a system test of another package may be serving meanwhile.
func TestBenchSystemEndToEnd(t *testing.T) {
	t.Parallel()
	amqpURL := amqptest.VHost(t)
	ctx := context.Background()
	admin := pgtest.URL()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		t.Fatalf("PostgreSQL: %v", err)
	}
	defer conn.Close(ctx)
	benchDBs := func() []string {
		rows, err := conn.Query(ctx, "SELECT datname FROM pg_database WHERE datname LIKE 'km0\\_bench\\_%' ORDER BY 1")
		if err != nil {
			t.Fatal(err)
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return names
	}
	before := benchDBs()

	exe := km0Bin(t)
	parts := []string{"relay"}
	// A km0 without --service-database-url uses km0_<service> of the server:
	// the benchmark refuses to touch one that exists (it may be someone's),
	// so those parts run only where it is absent.
	helpCmd := exec.Command(exe, "serve", "inventari", "--help")
	helpCmd.Env = append(os.Environ(), runMainEnv+"=1")
	help, _ := helpCmd.CombinedOutput()
	for _, svc := range []string{"inventari", "pagaments"} {
		var exists bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", "km0_"+svc).Scan(&exists); err != nil {
			t.Fatal(err)
		}
		if exists && !bytes.Contains(help, []byte("service-database-url")) {
			t.Logf("not running the %s part: this km0 has no --service-database-url and km0_%s exists on the server", svc, svc)
			continue
		}
		parts = append(parts, svc)
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "bench", "system", "--only", strings.Join(parts, ","), "--n", "300", "--rounds", "1",
		"--rr-serial", "20", "--rr-requests", "200", "--rr-callers", "8", "--timeout", "2m",
		"--database-url", admin, "--amqp-url", amqpURL)
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("km0 bench system: %v\nstdout:\n%s\nstderr:\n%s", err, out, stderr.String())
	}

	t.Logf("km0 bench system:\n%s", out)
	count := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("not a JSON line: %q: %v", line, err)
		}
		num := func(k string) float64 {
			v, ok := m[k].(float64)
			if !ok {
				t.Errorf("%s: no number %q", line, k)
			}
			return v
		}
		bench, _ := m["bench"].(string)
		side, _ := m["side"].(string)
		count[bench+"/"+side]++
		switch {
		case bench == "system_relay" && side != "":
			if num("events") != 300 || num("published") != 300 || num("records") < 300 || num("events_per_s") <= 0 || num("rss_mb") <= 0 {
				t.Errorf("relay %s: %s", side, line)
			}
		case bench == "system_inventari" && side != "":
			if num("applied")+num("refused") != 300 || num("applied") == 0 || m["stock_exact"] != true || num("duplicates") != 0 || num("events_per_s") <= 0 {
				t.Errorf("inventari %s: %s", side, line)
			}
		case bench == "system_pagaments" && side != "":
			want := map[float64]float64{1: 20, 8: 200}[num("callers")]
			if want == 0 || num("requests") != want || num("req_per_s") <= 0 || num("p50_ms") <= 0 || num("p99_ms") < num("p50_ms") {
				t.Errorf("pagaments %s: %s", side, line)
			}
		case side == "": // the round and summary lines
			if r, ok := m["median_ratio"]; ok && r.(float64) <= 0 {
				t.Errorf("summary without a ratio: %s", line)
			}
			if r, ok := m["ratio"]; ok && r.(float64) <= 0 {
				t.Errorf("round without a ratio: %s", line)
			}
		}
	}
	for _, part := range parts {
		b := "system_" + part
		want := map[string]int{b + "/km0": 1, b + "/seed_port": 1, b + "/": 1, b + "_round/": 1}
		if part == "pagaments" {
			want[b+"/km0"], want[b+"/seed_port"] = 2, 2 // 1 caller, then 8
		}
		for k, n := range want {
			if count[k] != n {
				t.Errorf("%d lines of %s, want %d; output:\n%s", count[k], k, n, out)
			}
		}
	}
	if after := benchDBs(); len(after) != len(before) {
		t.Errorf("databases km0_bench_* before the run %v, after %v: the benchmark left some behind", before, after)
	}
}
