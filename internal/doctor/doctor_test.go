package doctor

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/km0/km0/internal/services/system"
)

// Check refuses, before connecting anywhere, a deployment it cannot check:
// events or request/reply on Kafka without brokers, or no database.
func TestCheckRefusesWhatItCannotCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	if _, err := Check(ctx, Config{DatabaseURL: "postgres://nobody@127.0.0.1:1/x"}); err == nil || !strings.Contains(err.Error(), "no Kafka brokers") {
		t.Errorf("events on Kafka, no brokers: %v", err)
	}
	// Everything on RabbitMQ: no Kafka needed, but a database is.
	cfg := Config{AMQPURL: "amqp://127.0.0.1:1/", System: system.Config{Events: system.EventsRabbitMQ}}
	if _, err := Check(ctx, cfg); err == nil || !strings.Contains(err.Error(), "no database") {
		t.Errorf("no database: %v", err)
	}
}

// Print writes one aligned row per finding with what to change, and the
// counts; with JSON, the findings as an array, without an empty fix.
func TestReportPrintsEachFindingAndTheCounts(t *testing.T) {
	t.Parallel()
	var r Report
	r.ok("postgres connection", "db:5432", "connected")
	r.warn("kafka connection", "k:9092", "plaintext", "turn on\nTLS")
	r.fail("kafka topic", "t", "missing", "create it")
	var out bytes.Buffer
	if err := r.Print(&out, false); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CHECK", "WHAT TO CHANGE", "FAIL: missing", "turn on TLS", "3 checks: 1 failed, 1 warnings"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	if r.Failed() != 1 || len(r.Findings()) != 3 {
		t.Errorf("Failed %d, Findings %d; want 1, 3", r.Failed(), len(r.Findings()))
	}
	out.Reset()
	if err := r.Print(&out, true); err != nil {
		t.Fatal(err)
	}
	var rows []map[string]any
	if err := json.Unmarshal(out.Bytes(), &rows); err != nil || len(rows) != 3 || rows[0]["fix"] != nil || rows[2]["result"] != ResultFail {
		t.Errorf("JSON %v (%v):\n%s", rows, err, out.String())
	}
}
