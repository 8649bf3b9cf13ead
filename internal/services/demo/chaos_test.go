package demo_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/demo"
)

// TestChaosShortForm builds km0 and runs the short form of `km0 demo
// --chaos` as a user would: 300 orders over 30 s through POST /comandes while
// five services are SIGKILLed and restarted, the broker (a `km0 kafka
// --data-dir` process) is SIGKILLed for 5 s and restarted on the same data,
// its own PostgreSQL cluster is restarted -m fast and -m immediate, and 30
// poison records are produced straight to the topics. It asserts exit 0 and
// the report's numbers, which follow from the plan: of 300 orders, 3 are
// invalid (13, 110, 207) and 3 refused by the card authorisation (17, 118,
// 219); 30 are submitted twice with one Idempotency-Key. Seed 3's schedule
// failed before comandes claimed the key first (two same-key pairs answered
// 409) and, before dead members were expired, left cataleg's group without
// progress for ~40 s.
func TestChaosShortForm(t *testing.T) {
	t.Parallel()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go tool is needed to build km0 for the chaos run: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	km0 := filepath.Join(t.TempDir(), "km0")
	build := exec.CommandContext(ctx, goBin, "build", "-o", km0, "github.com/km0/km0/cmd/km0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build km0: %v\n%s", err, out)
	}
	var stdout, stderr bytes.Buffer
	run := exec.CommandContext(ctx, km0, "demo", "--chaos", "--json", "--own-postgres", "--orders", "300", "--kills", "5",
		"--duration", "30s", "--broker-down", "5s", "--seed", "3", "--settle-timeout", "90s")
	run.Stdout, run.Stderr = &stdout, &stderr
	start := time.Now()
	err = run.Run()
	t.Logf("km0 demo --chaos ran %.1f s", time.Since(start).Seconds())
	var r demo.ChaosReport
	if jerr := json.Unmarshal(stdout.Bytes(), &r); jerr != nil {
		t.Fatalf("report is not JSON (%v; exit %v):\n%.2000s\n%s", jerr, err, stdout.String(), tail(stderr.String(), 60))
	}
	for _, inv := range r.Invariants {
		if !inv.OK {
			t.Errorf("invariant %q fails: %s", inv.Name, inv.Detail)
		}
	}
	var exit *exec.ExitError
	if err != nil {
		if errors.As(err, &exit) {
			t.Fatalf("km0 demo --chaos exited %d:\n%s", exit.ExitCode(), tail(stderr.String(), 60))
		}
		t.Fatalf("km0 demo --chaos: %v", err)
	}
	if !r.OK || !r.Settled || len(r.Invariants) < 17 || r.Seed != 3 {
		t.Fatalf("report OK=%v settled=%v with %d invariants, seed %d:\n%s", r.OK, r.Settled, len(r.Invariants), r.Seed, tail(stderr.String(), 60))
	}
	svcKills, brokerKills := r.Kills()
	pg := 0
	for _, f := range r.Done {
		if f.Err == "" && strings.HasPrefix(f.Kind, "postgres-") {
			pg++
		}
	}
	if svcKills != 5 || brokerKills != 1 || pg != 2 {
		t.Errorf("faults: %d service SIGKILLs (want 5), %d broker (want 1), %d PostgreSQL restarts (want 2)", svcKills, brokerKills, pg)
	}
	o := r.Orders
	// 8 orders to Perpinyà: 207 is invalid (400), the other 7 are refused
	// at creation (422 ciutat_no_coberta).
	if o.Planned != 300 || o.Accepted != 287 || o.Invalid != 3 || o.Refused != 3 || o.NotCovered != 7 || o.Replayed != 30 || o.Unanswered != 0 || o.ReplayDiffers != 0 {
		t.Errorf("orders: %+v", o)
	}
	// Cancelled orders (the client's, and the cheese orders refused for
	// stock) are compensated: charged ⇒ refunded, or never charged.
	c := r.Compensation
	if c == nil || o.Cancelled == 0 || c.ByReason["client"] != o.Cancelled || c.ByReason["estoc_insuficient"] == 0 || c.Owed != 0 || c.Charged != c.Refunded {
		t.Errorf("cancellations %d, compensation %v", o.Cancelled, c)
	} else if c.Rejected != 0 || c.RejectedCharged != 0 {
		t.Errorf("rejected by repartiment %d, left charged %d: want 0 (Perpinyà is refused at creation)", c.Rejected, c.RejectedCharged)
	} else if p := r.Payments; p.Payments != 287-c.NeverCharged-c.ChargedUnbooked || p.GatewayCharges != p.Payments+c.ChargedUnbooked ||
		p.OrdersPaid != p.Payments-(c.Charged-c.ChargedUnbooked) || p.ChargedTwice != 0 {
		t.Errorf("payments: %+v (%d cancelled orders charged, %d never charged)", p, c.Charged, c.NeverCharged)
	}
	if s := r.Stock[demo.Cheese]; s.Final != 1 || s.Catalog != 1 || !s.LowStock {
		t.Errorf("cheese: %+v", s)
	}
	if len(r.Poison) != 30 {
		t.Errorf("%d poison records, want 30", len(r.Poison))
	}
	for _, p := range r.Poison {
		if !p.OK {
			t.Errorf("poison %s at %s/%d@%d: %v; after it: %v", p.Name, p.Topic, p.Partition, p.Offset, p.Groups, p.After)
		}
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
