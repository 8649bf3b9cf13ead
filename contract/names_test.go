package contract_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/contract"
)

// One classifier groups dead letters for every consumer metric, the DLQ
// index and the demo; its label values stay bounded.
func TestReasonClassBoundsLabelValues(t *testing.T) {
	t.Parallel()
	for motiu, want := range map[string]string{
		"permanent: esquema: comanda.creada v1 sense adreca_lliurament": "permanent: esquema",
		"permanent: envelope: malformed JSON: unexpected end":           "permanent: envelope",
		"permanent: estoc insuficient: formatge-curat":                  "permanent: estoc insuficient",
		"permanent: Ciutat_No_Coberta: Figueres":                        "permanent: ciutat_no_coberta",
		"transitori esgotat: mapes 503: timeout":                        "transitori esgotat",
		"transitori esgotat: comanda P-2026-000123 sense resposta":      "transitori esgotat",
		"permanent: " + strings.Repeat("a", 40) + ": x":                 "permanent",
		"alguna altra cosa": "altres",
	} {
		if got := contract.ReasonClass(motiu); got != want {
			t.Errorf("ReasonClass(%q) = %q, want %q", motiu, got, want)
		}
	}
}

func TestIdempotencyKeyPrefersAValidCorrelator(t *testing.T) {
	t.Parallel()
	for raw, want := range map[string]string{
		"":                                   "E1",
		`"C1"`:                               "C1",
		`""`:                                 "E1",
		`42`:                                 "E1",
		`"` + strings.Repeat("c", 257) + `"`: "E1",
		`"a\u0000b"`:                         "E1",
	} {
		if got := contract.IdempotencyKey("E1", json.RawMessage(raw)); got != want {
			t.Errorf("IdempotencyKey(E1, %s) = %q, want %q", raw, got, want)
		}
	}
}

func TestDerivedNames(t *testing.T) {
	t.Parallel()
	if got := contract.RetryTopic("t"); got != "t.retry" {
		t.Error(got)
	}
	if got := contract.DLQName("q"); got != "q.dlq" {
		t.Error(got)
	}
	if got := contract.WaitQueueName("q", 1500*time.Millisecond); got != "q.espera.1500" {
		t.Error(got)
	}
}
