package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
)

// km0 dlq sequence --skip gives up the head of P-9 (its letter purged, one
// skip entry in the audit log with the reason) and replays the letter of
// e-B1, which becomes the head: its consumer applies it and releases e-B2.
// Without --reason it refuses and changes nothing.
func TestDLQSequenceSkipGivesUpTheHeadAndReleasesTheRest(t *testing.T) {
	t.Parallel()
	h := newDLQHarness(t)
	headLetter, b1Letter := h.blockSequence()
	if out, err := h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc", "--key", "P-9", "--skip"); err == nil {
		t.Fatalf("--skip without --reason: no error\n%s", out)
	}
	out, err := h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc", "--key", "P-9", "--skip",
		"--reason", "negative price, never valid", "--watch", "0")
	if err != nil || !strings.Contains(out, "skipped the head "+headLetter) || !strings.Contains(out, "replayed "+b1Letter+", the new head") {
		t.Fatalf("sequence --skip: %v\n%s", err, out)
	}
	recs := kafkatest.ReadAll(t, h.broker, "comandes.esdeveniments", 1, 10*time.Second)
	if len(recs) != 1 || !strings.Contains(string(recs[0].Value), `"e-B1"`) {
		t.Fatalf("%d record(s) on the original topic, want e-B1's alone", len(recs))
	}
	var headID string
	if err := h.schema.Pool.QueryRow(context.Background(), `SELECT id_missatge FROM claus_bloquejades WHERE clau = 'P-9'`).Scan(&headID); err != nil ||
		headID != "e-B1" {
		t.Fatalf("head of P-9 after the skip: %q %v, want e-B1", headID, err)
	}
	out, err = h.run("", false, "audit")
	// The index stores accio salt and resultat "fet: skipped: …"; people read English.
	if err != nil || strings.Count(out, "  skip  ") != 1 || !strings.Contains(out, "done: skipped: negative price, never valid") ||
		strings.Contains(out, "salt") || strings.Contains(out, "fet") {
		t.Fatalf("audit after the skip: %v\n%s", err, out)
	}
}
