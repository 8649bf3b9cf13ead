package console_test

import (
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/dlq"
)

// The page of a letter that is a key's blocked head shows the key's
// sequence (the messages parked behind it, in order) and replays it as one,
// with the same login and form token as every action: the head goes back to
// its topic alone and the blocked letter is marked purged.
func TestLetterPageShowsAndReplaysABlockedSequence(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
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
	if _, body := br.get("/carta?id=" + url.QueryEscape(behind)); strings.Contains(body, "replay-sequence") {
		t.Fatalf("a letter that is not a head offers a sequence replay:\n%s", body)
	}
	form := url.Values{"consumidor": {"pagaments.comandes"}, "clau": {"P-2026-9"}}
	if resp, _ := br.post("/sequencia/reproduir", form); resp.StatusCode != http.StatusForbidden || b.records(t, comandes) != 0 {
		t.Fatalf("replay without the form token: %d, %d records; want 403 and nothing published", resp.StatusCode, b.records(t, comandes))
	}
	form.Set("csrf", csrf)
	resp, body := br.post("/sequencia/reproduir", form)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b id="replayed-head">`+head+`</b>`) {
		t.Fatalf("replay: %d\n%s", resp.StatusCode, body)
	}
	if n := b.records(t, comandes); n != 1 {
		t.Fatalf("%d records on %s, want the head alone", n, comandes)
	}
	if l, err := b.svc.Get(b.ctx, behind); err != nil || l.State != dlq.StatePurged {
		t.Fatalf("the blocked letter: %v %v, want purged", l, err)
	}
}

func jsonMS() string { return strconv.FormatInt(time.Now().UnixMilli(), 10) }
