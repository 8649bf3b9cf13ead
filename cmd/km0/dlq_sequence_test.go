package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
)

// blockSequence blocks key P-9 of consumer inventari.descompte_estoc behind the
// dead-lettered head e-H, with e-B1 and e-B2 parked behind it, as a per-key
// order consumer leaves it, and dead-letters the head and e-B1 (blocked).
func (h *dlqHarness) blockSequence() (head, b1 string) {
	h.t.Helper()
	ctx := context.Background()
	if _, err := migrate.Up(ctx, h.schema.Pool, h.schema.Names(), keyorder.Migrations); err != nil {
		h.t.Fatal(err)
	}
	ko, err := keyorder.New(keyorder.Config{Schema: h.schema.Name})
	if err != nil {
		h.t.Fatal(err)
	}
	tx, err := h.schema.Pool.Begin(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if err := ko.MarkHeadBlocked(ctx, tx, "inventari.descompte_estoc", "P-9", keyorder.Head{MessageID: "e-H",
		Reason: keyorder.ReasonDeadLettered, LastError: "preu negatiu"}); err != nil {
		h.t.Fatal(err)
	}
	for i, id := range []string{"e-B1", "e-B2"} {
		m := keyorder.Message{ID: id, Topic: "comandes.esdeveniments", Partition: 2, Offset: int64(10 + i), Value: []byte(`{}`),
			Headers: []keyorder.Header{{Key: "tipus", Value: "comanda.cancellada"}, {Key: "id_esdeveniment", Value: id}}}
		if _, _, err := ko.Park(ctx, tx, "inventari.descompte_estoc", "P-9", m); err != nil {
			h.t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		h.t.Fatal(err)
	}
	env := func(id, tipus string) []byte {
		return []byte(`{"id_esdeveniment":"` + id + `","tipus":"` + tipus + `","versio":1,"data_ms":` +
			jsonNumber(time.Now().UnixMilli()) + `,"origen":"comandes","dades":{"id":"P-9"}}`)
	}
	head = h.dead("P-9", "permanent: preu negatiu", env("e-H", "comanda.creada"), "tipus", "comanda.creada", "id_esdeveniment", "e-H")
	b1 = h.dead("P-9", keyorder.BlockedReason("e-H"), env("e-B1", "comanda.cancellada"), "tipus", "comanda.cancellada", "id_esdeveniment", "e-B1")
	return head, b1
}

// km0 dlq sequence shows the head and the two messages behind it, in order,
// with their letters; --replay replays the head alone (the consumer releases
// the rest from its store) and marks the blocked letter purged.
func TestDLQSequenceShowsAndReplaysAKeyAsOne(t *testing.T) {
	t.Parallel()
	h := newDLQHarness(t)
	headLetter, b1Letter := h.blockSequence()
	out, err := h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc", "--key", "P-9")
	if err != nil {
		t.Fatalf("sequence: %v\n%s", err, out)
	}
	iB1, iB2 := strings.Index(out, "e-B1"), strings.Index(out, "e-B2")
	for _, want := range []string{"head:", "e-H (dead-lettered, since", "dead-lettered as blocked", "preu negatiu", headLetter, "2 message(s) behind it", b1Letter, "comanda.cancellada"} {
		if !strings.Contains(out, want) {
			t.Fatalf("sequence output lacks %q:\n%s", want, out)
		}
	}
	if iB1 < 0 || iB2 < iB1 {
		t.Fatalf("the messages behind are not listed in order:\n%s", out)
	}
	out, err = h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc")
	if err != nil || !strings.Contains(out, "1 key(s) blocked by inventari.descompte_estoc") || !strings.Contains(out, `"P-9"`) {
		t.Fatalf("sequence without --key: %v\n%s", err, out)
	}
	out, err = h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc", "--key", "P-1")
	if err != nil || !strings.Contains(out, "not blocked") {
		t.Fatalf("sequence of a free key: %v\n%s", err, out)
	}

	out, err = h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc", "--key", "P-9", "--replay")
	if err != nil || !strings.Contains(out, "replayed the head "+headLetter) || !strings.Contains(out, "marked purged "+b1Letter) {
		t.Fatalf("sequence --replay: %v\n%s", err, out)
	}
	recs := kafkatest.ReadAll(t, h.broker, "comandes.esdeveniments", 1, 10*time.Second)
	if len(recs) != 1 || string(recs[0].Key) != "P-9" || !strings.Contains(string(recs[0].Value), `"e-H"`) {
		t.Fatalf("%d records on the original topic, want the head alone", len(recs))
	}
	out, err = h.run("", false, "ls", "--state", "pending")
	if err != nil || !strings.Contains(out, "0 dead letter(s)") {
		t.Fatalf("after the replay the head's and the blocked letter must not be pending: %v\n%s", err, out)
	}
	// The head has no pending letter any more: a second replay is refused.
	if out, err = h.run("", false, "sequence", "--consumer", "inventari.descompte_estoc", "--key", "P-9", "--replay"); err == nil ||
		!strings.Contains(err.Error(), "no pending dead letter") {
		t.Fatalf("second replay: %v\n%s", err, out)
	}
}
