package lag_test

import (
	"encoding/json"
	"os"
	"regexp"
	"testing"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/requestreply"
)

// The Grafana dashboard queries only metrics km0 exports: a renamed metric
// fails here instead of leaving an empty panel.
func TestDashboardUsesRealMetricNames(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../deploy/grafana/km0.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Targets []struct{ Expr string } `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	known := map[string]bool{
		// dlq.Alerter's counters.
		"km0_dlq_letters_total": true, "km0_dlq_webhook_failures_total": true,
	}
	for _, n := range []string{relay.MetricPublished, relay.MetricParked, relay.MetricFailures, relay.MetricShards,
		relay.MetricPending, relay.MetricOldest, relay.MetricPruned, relay.MetricTableBytes,
		consumer.MetricMessages, consumer.MetricDLQ, consumer.MetricHeld, consumer.MetricConflicts, consumer.MetricLag, consumer.MetricOldest,
		requestreply.MetricServerRequests, requestreply.MetricUnauthenticated,
		lag.MetricGroupLag, lag.MetricGroupOldest, lag.MetricOutboxPending, lag.MetricOutboxOldest,
		lag.MetricQueueReady, lag.MetricQueueUnacked, lag.MetricQueueConsumers, lag.MetricSampleTime, lag.MetricSampleErrors} {
		known[n] = true
	}
	name := regexp.MustCompile(`km0_[a-z_]+`)
	used := 0
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			for _, m := range name.FindAllString(tg.Expr, -1) {
				used++
				if !known[m] {
					t.Errorf("dashboard queries %s, which km0 does not export", m)
				}
			}
		}
	}
	if used < 20 {
		t.Fatalf("only %d metric references in the dashboard", used)
	}
}
