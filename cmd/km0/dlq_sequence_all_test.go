package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/keyorder"
)

// A replay that does not take is said plainly: the consumer dead-letters the
// head again while `km0 dlq sequence --replay` watches, and the command
// fails with "did not take: dead-lettered again: <motiu>".
func TestDLQSequenceReplaySaysWhenItDidNotTake(t *testing.T) {
	t.Parallel()
	h := newDLQHarness(t)
	h.blockSequence()
	value := []byte(`{"id_esdeveniment":"e-H","tipus":"comanda.creada","versio":1,"data_ms":` +
		jsonNumber(time.Now().UnixMilli()) + `,"origen":"comandes","dades":{"id":"P-9"}}`)
	again := make(chan string, 1)
	go func() { // the consumer: it gets the head and fails again
		kafkatest.ReadAll(t, h.broker, "comandes.esdeveniments", 1, 20*time.Second)
		again <- h.dead("P-9", "permanent: preu negatiu", value, "tipus", "comanda.creada", "id_esdeveniment", "e-H")
	}()
	out, err := h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc", "--key", "P-9", "--replay", "--watch", "20s")
	letter := <-again
	if err == nil || !strings.Contains(err.Error(), "1 replay(s) did not take") ||
		!strings.Contains(out, "did not take: dead-lettered again: permanent: preu negatiu (letter "+letter+")") {
		t.Fatalf("sequence --replay of a head that fails again: %v\n%s", err, out)
	}
	if out, err := h.run("", false, "audit", "--id", letter); err != nil || !strings.Contains(out, "RESULT") {
		t.Fatalf("audit: %v\n%s", err, out)
	}
}

// `km0 dlq sequence --consumer C --replay` without --key replays every key C
// blocks, each as one: two blocked keys, two heads on the topic, no pending
// letter left; the audit log names the CLI's user.
func TestDLQSequenceReplayWithoutKeyReplaysEveryBlockedKey(t *testing.T) {
	t.Parallel()
	h := newDLQHarness(t)
	h.blockSequence() // P-9: head e-H, e-B1 and e-B2 behind
	ctx := context.Background()
	ko, err := keyorder.New(keyorder.Config{Schema: h.schema.Name})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := h.schema.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ko.MarkHeadBlocked(ctx, tx, "inventari.descompte_estoc", "P-8", keyorder.Head{MessageID: "e-H8",
		Reason: keyorder.ReasonDeadLettered, LastError: "db: permission denied"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.dead("P-8", "transitori esgotat: permission denied", []byte(`{"id_esdeveniment":"e-H8","tipus":"comanda.creada","versio":1,"data_ms":`+
		jsonNumber(time.Now().UnixMilli())+`,"origen":"comandes","dades":{"id":"P-8"}}`), "tipus", "comanda.creada", "id_esdeveniment", "e-H8")

	out, err := h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc", "--replay", "--watch", "0")
	if err != nil || !strings.Contains(out, "replayed 2 blocked sequence(s) of inventari.descompte_estoc, 0 refused") {
		t.Fatalf("sequence --replay without --key: %v\n%s", err, out)
	}
	recs := kafkatest.ReadAll(t, h.broker, "comandes.esdeveniments", 2, 10*time.Second)
	heads := map[string]bool{}
	for _, r := range recs {
		heads[string(r.Key)] = true
	}
	if len(recs) != 2 || !heads["P-8"] || !heads["P-9"] {
		t.Fatalf("records on the topic: %d (keys %v), want the two heads", len(recs), heads)
	}
	if out, err := h.run("", false, "ls", "--state", "pending"); err != nil || !strings.Contains(out, "0 dead letter(s)") {
		t.Fatalf("pending after replaying every sequence: %v\n%s", err, out)
	}
	// The index stores accio reproduccio and resultat fet; people read English
	// (three entries: the two heads' replays and the purge of e-B1's letter).
	if out, err := h.run("", false, "audit"); err != nil || strings.Count(out, "  replay  ") != 2 || strings.Count(out, "  done\n") != 3 ||
		!strings.Contains(out, "cli:") || strings.Contains(out, "reproduccio") {
		t.Fatalf("audit log: %v\n%s", err, out)
	}
}
