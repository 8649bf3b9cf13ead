package bench

import (
	"context"
	"strings"
	"testing"

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

// `km0 bench latency` refuses what its --outbox and --relay-process do not
// take, before it connects anywhere.
func TestBenchLatencyRefusesBadFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--outbox", "disk"}, `--outbox "disk"`},
		{[]string{"--outbox", "wal", "--workers", "2"}, "the polling relay's"},
		{[]string{"--outbox", "wal", "--baseline"}, "the polling relay's"},
		{[]string{"--relay-process", "--baseline"}, "this process only"},
	} {
		err := benchLatency(context.Background(), append([]string{"--database-url", "postgres://nobody@127.0.0.1:1/x"}, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("km0 bench latency %v: %v, want an error with %q", c.args, err, c.want)
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
