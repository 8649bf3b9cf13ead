package console_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
)

// blockedHead is how blockKeyWith's head failed.
type blockedHead struct {
	lastError string // keyorder.Head.LastError
	motiu     string // the head letter's motiu
	tipus     string // the letters' tipus
	attempts  string // the letters' intents header
}

// blockKey blocks key P-2026-9 of pagaments.comandes behind the
// dead-lettered head e-cap (a v1 comanda.pagada without an address), with
// e-darrere-1 and e-darrere-2 parked behind it, and dead-letters e-cap and
// e-darrere-1 (blocked); it returns their letters.
func (b *bundle) blockKey(t *testing.T) (head, behind string) {
	t.Helper()
	return b.blockKeyWith(t, blockedHead{lastError: "esquema: falta l'adreça", motiu: "permanent: esquema: falta l'adreça",
		tipus: "comanda.pagada", attempts: "1"})
}

// blockKeyWith is blockKey with the head's failure h.
func (b *bundle) blockKeyWith(t *testing.T, h blockedHead) (head, behind string) {
	t.Helper()
	if _, err := migrate.Up(b.ctx, b.schema.Pool, b.schema.Names(), keyorder.Migrations); err != nil {
		t.Fatal(err)
	}
	ko, err := keyorder.New(keyorder.Config{Schema: b.schema.Name})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := b.schema.Pool.Begin(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(b.ctx) //nolint:errcheck
	if err := ko.MarkHeadBlocked(b.ctx, tx, "pagaments.comandes", "P-2026-9", keyorder.Head{MessageID: "e-cap",
		Reason: keyorder.ReasonDeadLettered, LastError: h.lastError}); err != nil {
		t.Fatal(err)
	}
	for i, id := range []string{"e-darrere-1", "e-darrere-2"} {
		if _, _, err := ko.Park(b.ctx, tx, "pagaments.comandes", "P-2026-9", keyorder.Message{ID: id, Topic: comandes,
			Offset: int64(i), Value: []byte(`{}`), Headers: []keyorder.Header{{Key: "tipus", Value: "comanda.cancellada"}}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(b.ctx); err != nil {
		t.Fatal(err)
	}
	letter := func(eid, motiu string) string {
		id, err := b.keyLetter("P-2026-9", eid, motiu, h)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	head = letter("e-cap", h.motiu)
	behind = letter("e-darrere-1", keyorder.BlockedReason("e-cap"))
	if _, err := b.svc.Sync(b.ctx); err != nil {
		t.Fatal(err)
	}
	return head, behind
}

// keyLetter writes a dead letter of event eid of key to the DLQ, as the
// per-key order consumer pagaments.comandes writes it (no consumer group
// header: a replay goes back to the topic), and returns its id. It does not
// sync the index; it does not fail the test, so a goroutine standing for the
// consumer may call it.
func (b *bundle) keyLetter(key, eid, motiu string, h blockedHead) (string, error) {
	r := &kgo.Record{Topic: comandesDLQ, Key: []byte(key), Value: []byte(`{"id_esdeveniment":"` + eid +
		`","tipus":"` + h.tipus + `","versio":1,"data_ms":` + jsonMS() + `,"origen":"comandes","dades":{"client":"` + customer + `"}}`),
		Timestamp: time.Now(), Headers: []kgo.RecordHeader{{Key: "motiu", Value: []byte(motiu)}, {Key: "intents", Value: []byte(h.attempts)},
			{Key: "topic_original", Value: []byte(comandes)}, {Key: "id_esdeveniment", Value: []byte(eid)}}}
	if err := b.client.ProduceSync(b.ctx, r).FirstErr(); err != nil {
		return "", err
	}
	return dlq.KafkaID(r.Topic, r.Partition, r.Offset), nil
}

// The blocked keys page offers to skip a dead-lettered head, with a
// confirm step that shows what the skip does and asks for the reason; the
// skip needs the login, the form token, a reason and the head the operator
// saw. Confirmed, the head's letter is purged and audited as one skip by
// the session, and the letter of the message behind it, now the head, is
// replayed alone.
func TestBlockedKeysPageSkipsAHeadAfterConfirming(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	head, behind := b.blockKey(t)
	br := b.browser(t)
	form := url.Values{"consumidor": {"pagaments.comandes"}, "clau": {"P-2026-9"}}
	if resp, _ := br.post("/sequencia/saltar", form); resp.StatusCode == http.StatusOK {
		t.Fatalf("skip without login: %d", resp.StatusCode)
	}
	csrf := br.login(token)
	if _, body := br.get("/claus"); !strings.Contains(body, `class="skip-head"`) {
		t.Fatalf("the blocked keys page offers no skip:\n%s", body)
	}
	if _, body := br.get("/carta?id=" + url.QueryEscape(head)); !strings.Contains(body, `id="skip-head"`) {
		t.Fatalf("the head's letter page offers no skip:\n%s", body)
	}
	if resp, _ := br.post("/sequencia/saltar", form); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("skip without the form token: %d, want 403", resp.StatusCode)
	}
	form.Set("csrf", csrf)
	resp, body := br.post("/sequencia/saltar", form)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b id="skip-head">e-cap</b>`) || !strings.Contains(body, `<b id="skip-behind">2</b>`) ||
		!strings.Contains(body, `id="skip-confirm"`) || !strings.Contains(body, head) {
		t.Fatalf("skip confirm step: %d\n%s", resp.StatusCode, body)
	}
	form.Set("confirmo", "1")
	form.Set("cap", "e-cap")
	if resp, body := br.post("/sequencia/saltar", form); resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="skip-need-reason"`) {
		t.Fatalf("skip without a reason: %d\n%s", resp.StatusCode, body)
	}
	form.Set("motiu", "v1 comanda.pagada without an address: never valid")
	form.Set("cap", "e-other")
	if resp, _ := br.post("/sequencia/saltar", form); resp.StatusCode != http.StatusConflict {
		t.Fatalf("skip of a head the operator did not see: %d, want 409", resp.StatusCode)
	}
	if n := b.records(t, comandes); n != 0 {
		t.Fatalf("%d record(s) published before the confirmed skip", n)
	}
	form.Set("cap", "e-cap")
	resp, body = br.post("/sequencia/saltar", form)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b class="skipped-letter">`+head+`</b>`) ||
		!strings.Contains(body, `<b id="skip-next">`+behind+`</b>`) {
		t.Fatalf("skip: %d\n%s", resp.StatusCode, body)
	}
	if n := b.records(t, comandes); n != 1 {
		t.Fatalf("%d record(s) on %s, want the letter behind the head alone", n, comandes)
	}
	if l, err := b.svc.Get(b.ctx, head); err != nil || l.State != dlq.StatePurged {
		t.Fatalf("the skipped head's letter: %v %v, want purged", l, err)
	}
	log, err := b.svc.AuditLog(b.ctx, dlq.AuditFilter{})
	if err != nil {
		t.Fatal(err)
	}
	skips := 0
	for _, e := range log {
		if e.Action == dlq.ActionSkip {
			skips++
			if !strings.HasPrefix(e.Actor, "console:") || strings.Join(e.Letters, ",") != head || !strings.Contains(e.Result, "never valid") {
				t.Fatalf("skip audit entry: %+v", e)
			}
		}
	}
	if skips != 1 {
		t.Fatalf("%d skip entries in the audit log, want 1: %+v", skips, log)
	}
	if _, body := br.get("/auditoria?carta=" + url.QueryEscape(head)); strings.Count(body, `class="audit-entry"`) != 1 ||
		!strings.Contains(body, `data-action="salt"`) || !strings.Contains(body, "never valid") {
		t.Fatalf("the audit log page of the head's letter:\n%s", body)
	}
	var next string
	if err := b.schema.Pool.QueryRow(b.ctx, `SELECT id_missatge FROM claus_bloquejades WHERE clau = 'P-2026-9'`).Scan(&next); err != nil || next != "e-darrere-1" {
		t.Fatalf("head after the skip: %q %v, want e-darrere-1", next, err)
	}
}
