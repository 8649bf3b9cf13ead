package bench

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/km0/km0/internal/pgtest"
)

// `km0 bench commit` refuses an unknown side and non-positive numbers, and
// on the machine's server measures each side it is given at the paced rate:
// every side's line counts its events and its p50 <= p99.
func TestBenchCommitMeasuresEachSide(t *testing.T) {
	ctx := context.Background()
	for _, args := range [][]string{{"--sides", "table,nope"}, {"--rate", "0"}, {"--writers", "-1"}} {
		if err := benchCommit(ctx, args); err == nil {
			t.Errorf("km0 bench commit %v: want an error", args)
		}
	}
	var err error
	out := captureStderr(t, func() {
		err = benchCommit(ctx, []string{"--database-url", pgtest.URL(), "--sides", "plain,table,table_nolock,table_nonotify",
			"--rate", "200", "--writers", "4", "--seconds", "0.5"})
	})
	if err != nil {
		t.Fatalf("km0 bench commit: %v\n%s", err, out)
	}
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var r map[string]any
		if json.Unmarshal([]byte(line), &r) != nil {
			continue // a log line
		}
		b, _ := r["bench"].(string)
		if b == "commit" {
			if r["table_p99_vs_plain"] == nil {
				t.Errorf("summary without table_p99_vs_plain: %s", line)
			}
			continue
		}
		seen[b] = true
		if ev, _ := r["events"].(float64); ev < 50 || r["p50_ms"].(float64) > r["p99_ms"].(float64) {
			t.Errorf("%s: %s; want at least 50 events (200/s for 0.5 s) and p50 <= p99", b, line)
		}
	}
	if len(seen) != 4 {
		t.Fatalf("sides measured: %v, want 4\n%s", seen, out)
	}
}
