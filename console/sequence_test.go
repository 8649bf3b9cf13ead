package console_test

import (
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/keyorder"
)

// The page of a letter that is a key's blocked head shows the key's
// sequence (the messages parked behind it, in order) and replays it as one,
// with the same login and form token as every action: the head goes back to
// its topic alone and the blocked letter is marked purged.
func TestLetterPageShowsAndReplaysABlockedSequence(t *testing.T) {
	t.Parallel()
	b := setupWith(t, token, func(c *console.Config) { c.ReplayWatch = time.Second })
	head, behind := b.blockKeyWith(t, blockedHead{lastError: "passarel·la: 503", motiu: "transitori esgotat: passarel·la: 503",
		tipus: "comanda.creada", attempts: "3"})

	br := b.browser(t)
	if resp, _ := br.get("/carta?id=" + url.QueryEscape(head)); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("letter page without login: %d, want the redirect to the login", resp.StatusCode)
	}
	csrf := br.login(token)
	_, body := br.get("/carta?id=" + url.QueryEscape(head))
	i1, i2 := strings.Index(body, "e-darrere-1"), strings.Index(body, "e-darrere-2")
	if !strings.Contains(body, "Blocked key <code>P-2026-9</code> (pagaments.comandes)") || i1 < 0 || i2 < i1 ||
		!strings.Contains(body, `id="replay-sequence"`) || !strings.Contains(body, behind) {
		t.Fatalf("the head's page lacks its sequence in order:\n%s", body)
	}
	// The stored motiu (dlq) and estat (morta_per_bloqueig, darrere_dlq) read in English.
	for _, want := range []string{"(dead-lettered since", "<td>dead-lettered as blocked</td>"} {
		if !strings.Contains(body, want) || strings.Contains(body, "morta_per_bloqueig") || strings.Contains(body, "darrere_dlq") {
			t.Fatalf("the head's page lacks %q or shows a stored estat:\n%s", want, body)
		}
	}
	if _, body := br.get("/carta?id=" + url.QueryEscape(behind)); strings.Contains(body, "replay-sequence") {
		t.Fatalf("a letter that is not a head offers a sequence replay:\n%s", body)
	}
	form := url.Values{"consumidor": {"pagaments.comandes"}, "clau": {"P-2026-9"}}
	if resp, _ := br.post("/sequencia/reproduir", form); resp.StatusCode != http.StatusForbidden || b.records(t, comandes) != 0 {
		t.Fatalf("replay without the form token: %d, %d records; want 403 and nothing published", resp.StatusCode, b.records(t, comandes))
	}
	form.Set("csrf", csrf)
	resp, body := br.post("/sequencia/reproduir", form)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b id="replayed-head">`+head+`</b>`) ||
		!strings.Contains(body, `id="seq-took"`) || !strings.Contains(body, `<b id="behind">2</b>`) {
		t.Fatalf("replay: %d\n%s", resp.StatusCode, body)
	}
	if n := b.records(t, comandes); n != 1 {
		t.Fatalf("%d records on %s, want the head alone", n, comandes)
	}
	if l, err := b.svc.Get(b.ctx, behind); err != nil || l.State != dlq.StatePurged {
		t.Fatalf("the blocked letter: %v %v, want purged", l, err)
	}
}

// A sequence replay whose head fails again is reported as not taken: the
// consumer (here the test, once the head is on the topic) dead-letters the
// head's event again while the console watches, and the result page says
// "did not take: dead-lettered again: <motiu> (letter <new letter>)", links
// the new letter to edit and offers the skip, instead of claiming success.
func TestSequenceReplayThatDoesNotTakeIsReported(t *testing.T) {
	t.Parallel()
	b := setupWith(t, token, func(c *console.Config) { c.ReplayWatch = 20 * time.Second })
	h := blockedHead{lastError: "esquema: falta adreca", motiu: "permanent: esquema: falta adreca", tipus: "comanda.pagada", attempts: "1"}
	head, _ := b.blockKeyWith(t, h)
	br := b.browser(t)
	csrf := br.login(token)
	again := b.failAgain(t, 1, "P-2026-9", "e-cap", h)
	start := time.Now()
	resp, body := br.post("/sequencia/reproduir", url.Values{"csrf": {csrf}, "consumidor": {"pagaments.comandes"}, "clau": {"P-2026-9"}})
	letter := <-again
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b id="replayed-head">`+head+`</b>`) ||
		!strings.Contains(body, `id="seq-not-taken"`) || strings.Contains(body, `id="seq-took"`) ||
		!strings.Contains(body, "did not take: dead-lettered again: permanent: esquema: falta adreca (letter "+letter+")") ||
		!strings.Contains(body, `href="/carta/editar?id=`+strings.ReplaceAll(letter, "/", "%2f")+`"`) || !strings.Contains(body, `class="skip-head"`) {
		t.Fatalf("replay of a head that fails again: %d\n%s", resp.StatusCode, body)
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Fatalf("the answer took %s: the watch should end once the head died again, not at its 20 s bound", d)
	}
	if l, err := b.svc.Get(b.ctx, letter); err != nil || l.State != dlq.StatePending {
		t.Fatalf("the new letter of the head: %v %v, want pending", l, err)
	}
}

// failAgain stands for a consumer whose head fails again: once n records are
// on the topic (the replayed heads), it dead-letters event eid of key again
// and sends the new letter's id ("" after a failure, reported).
func (b *bundle) failAgain(t *testing.T, n int64, key, eid string, h blockedHead) <-chan string {
	out := make(chan string, 1)
	go func() {
		id := ""
		defer func() { out <- id }()
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			ends, err := b.adm.ListEndOffsets(b.ctx, comandes)
			var got int64
			if err == nil && ends.Error() == nil {
				ends.Each(func(o kadm.ListedOffset) { got += o.Offset })
			}
			if got >= n {
				var err error
				if id, err = b.keyLetter(key, eid, h.motiu, h); err != nil {
					t.Errorf("dead-letter %s again: %v", eid, err)
				}
				return
			}
			time.Sleep(20 * time.Millisecond) // polling the broker, as a consumer does
		}
		t.Errorf("%d record(s) never reached %s", n, comandes)
	}()
	return out
}

func jsonMS() string { return strconv.FormatInt(time.Now().UnixMilli(), 10) }

// The blocked keys page replays every blocked sequence of a consumer at
// once (as `km0 dlq sequence --replay` without --key), behind the login, the
// form token and a confirm step bound to the keys it listed. Three keys are
// blocked: P-2026-9 (its head fails again), P-2026-8 (its head takes) and
// P-2026-7 (its head waits for a retry: nothing to replay). The result says
// 2 replayed, 1 of them did not take, 1 refused, and names each key's fate;
// the two heads are on the topic, once each.
func TestBlockedKeysPageReplaysEverySequenceOfAConsumer(t *testing.T) {
	t.Parallel()
	b := setupWith(t, token, func(c *console.Config) { c.ReplayWatch = 3 * time.Second })
	h := blockedHead{lastError: "esquema: falta adreca", motiu: "permanent: esquema: falta adreca", tipus: "comanda.pagada", attempts: "1"}
	b.blockKeyWith(t, h)
	ko, err := keyorder.New(keyorder.Config{Schema: b.schema.Name})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := b.schema.Pool.Begin(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	for key, head := range map[string]keyorder.Head{
		"P-2026-8": {MessageID: "e-cap-8", Reason: keyorder.ReasonDeadLettered, LastError: "db: permission denied"},
		"P-2026-7": {MessageID: "e-cap-7", Reason: keyorder.ReasonRetry, LastError: "db: permission denied"},
	} {
		if err := ko.MarkHeadBlocked(b.ctx, tx, "pagaments.comandes", key, head); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(b.ctx); err != nil {
		t.Fatal(err)
	}
	head8, err := b.keyLetter("P-2026-8", "e-cap-8", "transitori esgotat: permission denied", h)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.svc.Sync(b.ctx); err != nil {
		t.Fatal(err)
	}

	form := url.Values{"servei": {""}, "consumidor": {"pagaments.comandes"}}
	if resp, _ := b.browser(t).post("/sequencies/reproduir", form); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("replay of every sequence without login: %d, want 401", resp.StatusCode)
	}
	br := b.browser(t)
	csrf := br.login(token)
	if _, body := br.get("/claus"); !strings.Contains(body, `data-consumer="pagaments.comandes"`) || !strings.Contains(body, `class="replay-all-sequences"`) ||
		!strings.Contains(body, "<td>dead-lettered") {
		t.Fatalf("the blocked keys page offers no replay of every sequence of the consumer, or does not say why in English:\n%s", body)
	}
	if resp, _ := br.post("/sequencies/reproduir", form); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("without the form token: %d, want 403", resp.StatusCode)
	}
	form.Set("csrf", csrf)
	resp, body := br.post("/sequencies/reproduir", form)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b id="seqall-count">3</b>`) || !strings.Contains(body, `id="seqall-confirm"`) ||
		!strings.Contains(body, "<code>P-2026-7</code>") || !strings.Contains(body, "<code>P-2026-9</code>") {
		t.Fatalf("confirm step: %d\n%s", resp.StatusCode, body)
	}
	plan := planOf(t, body)
	form.Set("confirmo", "1")
	if resp, _ := br.post("/sequencies/reproduir", form); resp.StatusCode != http.StatusConflict {
		t.Fatalf("confirmed without the confirm page's plan: %d, want 409", resp.StatusCode)
	}
	if n := b.records(t, comandes); n != 0 {
		t.Fatalf("%d record(s) published before the confirmation", n)
	}
	form.Set("pla", plan)
	again := b.failAgain(t, 2, "P-2026-9", "e-cap", h) // the keys go in order: P-2026-9's head is the second on the topic
	resp, body = br.post("/sequencies/reproduir", form)
	letter := <-again
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b id="seqall-replayed">2</b>`) ||
		!strings.Contains(body, `<b id="seqall-not-taken">1</b>`) || !strings.Contains(body, `<b id="seqall-refused">1</b>`) {
		t.Fatalf("replay of every sequence: %d\n%s", resp.StatusCode, body)
	}
	rows := map[string]string{}
	for _, m := range regexp.MustCompile(`<tr class="seqall-outcome" data-key="([^"]+)">([\s\S]*?)</tr>`).FindAllStringSubmatch(body, -1) {
		rows[m[1]] = m[2]
	}
	if len(rows) != 3 || !strings.Contains(rows["P-2026-9"], "did not take: dead-lettered again: permanent: esquema: falta adreca (letter "+letter+")") ||
		!strings.Contains(rows["P-2026-8"], "replayed: no new dead letter") || !strings.Contains(rows["P-2026-8"], head8) ||
		!strings.Contains(rows["P-2026-7"], "refused: nothing to replay") {
		t.Fatalf("the outcome of each key: %v\n%s", rows, body)
	}
	if n := b.records(t, comandes); n != 2 {
		t.Fatalf("%d record(s) on %s, want the two heads once each", n, comandes)
	}
	log, err := b.svc.AuditLog(b.ctx, dlq.AuditFilter{})
	if err != nil {
		t.Fatal(err)
	}
	replays := 0
	for _, e := range log {
		if e.Action == dlq.ActionReplay {
			replays++
			if !strings.HasPrefix(e.Actor, "console:") {
				t.Fatalf("replay audit entry not by the console session: %+v", e)
			}
		}
	}
	if replays != 2 {
		t.Fatalf("%d replay entries in the audit log, want 2: %+v", replays, log)
	}
	if resp, _ := br.post("/sequencies/reproduir", form); resp.StatusCode != http.StatusConflict || b.records(t, comandes) != 2 {
		t.Fatalf("the same confirmation again: %d, want 409 and nothing published (a plan is used once)", resp.StatusCode)
	}
}
