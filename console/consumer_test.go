package console_test

import (
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"
)

// One failure class in two consumers is two failure groups, each with its
// consumer in a column of the overview and a filter by consumer; a group's
// page, dry run and replay act on that consumer's letters only.
func TestGroupsByConsumer(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	now := time.Now()
	b.produceDeadBy(t, 2, class+": falta adreca", now, "repartiment")
	b.produceDeadBy(t, 3, class+": falta adreca", now, "inventari")
	br := b.browser(t)

	// Counts are open: the groups and the consumer column without login.
	_, body := br.get("/")
	rows := regexp.MustCompile(`<tr class="group" data-topic="`+regexp.QuoteMeta(comandesDLQ)+`" data-consumer="([a-z]+)" data-class="`+
		regexp.QuoteMeta(class)+`">[\s\S]*?<td class="num count">(\d+)</td>`).FindAllStringSubmatch(body, -1)
	if len(rows) != 2 || rows[0][1] != "inventari" || rows[0][2] != "3" || rows[1][1] != "repartiment" || rows[1][2] != "2" {
		t.Fatalf("groups by consumer: %v\n%s", rows, body)
	}
	if _, body := br.get("/?consumidor=inventari"); total(t, body) != "3" || strings.Contains(body, `data-consumer="repartiment"`) {
		t.Fatalf("filter consumidor=inventari:\n%s", body)
	}

	csrf := br.login(token)
	_, body = br.get("/grup?topic=" + comandesDLQ + "&consumidor=inventari&classe=" + url.QueryEscape(class))
	if !strings.Contains(body, `<b id="group-count">3</b>`) || !strings.Contains(body, `<span id="group-consumer">inventari</span>`) {
		t.Fatalf("group page of inventari:\n%s", body)
	}
	sel := url.Values{"csrf": {csrf}, "abast": {"grup"}, "topic": {comandesDLQ}, "consumidor": {"inventari"}, "classe": {class}}
	_, body = br.post("/reproduir/previsualitzar", sel)
	if !strings.Contains(body, `<b id="would">3</b>`) || !strings.Contains(body, `name="consumidor" value="inventari"`) {
		t.Fatalf("dry run of inventari's group:\n%s", body)
	}
	sel.Set("confirmo", "1")
	sel.Set("pla", planOf(t, body))
	resp, _ := br.post("/reproduir", sel)
	loc := resp.Header.Get("Location")
	if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(loc, "/feina?id=") {
		t.Fatalf("replay: %d %q", resp.StatusCode, loc)
	}
	st := br.waitJob(loc)

	if st.State != "done" || st.Total != 3 || st.Republished != 3 {
		t.Fatalf("job: %+v", st)
	}
	var left int
	if err := b.schema.Pool.QueryRow(b.ctx, "SELECT count(*) FROM cartes_mortes WHERE estat = 'pendent' AND grup_consumidor = 'repartiment'").Scan(&left); err != nil || left != 2 || b.pending(t) != 2 {
		t.Fatalf("pending after replaying inventari's group: repartiment %d, all %d (%v), want 2 and 2", left, b.pending(t), err)
	}
}

// A letter's time headers (primera_fallada here) show as dates, with the
// raw unix seconds on hover.
func TestLetterTimeHeadersAsDates(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	at := time.Date(2026, 11, 30, 8, 15, 42, 328000000, time.UTC)
	ids := b.produceDeadAt(t, 1, class+": x", at)
	br := b.browser(t)
	br.login(token)
	_, body := br.get("/carta?id=" + url.QueryEscape(ids[0]))
	want := `<tr><th>primera_fallada</th><td class="time" title="1796026542.328000">2026-11-30 08:15:42.328Z`
	if !strings.Contains(body, want) {
		t.Fatalf("letter page lacks %q:\n%s", want, body)
	}
}

// Replaying or purging a selection with nothing ticked leads back to the
// group's page, which says so; nothing is replayed.
func TestNothingTickedBackToGroup(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	b.produceDead(t, 2, class+": x")
	br := b.browser(t)
	csrf := br.login(token)
	for _, p := range []string{"/reproduir/previsualitzar", "/purgar/confirmar", "/reproduir", "/purgar"} {
		resp, _ := br.post(p, url.Values{"csrf": {csrf}, "abast": {"seleccio"}, "topic": {comandesDLQ},
			"consumidor": {"repartiment"}, "classe": {class}, "confirmo": {"1"}})
		loc := resp.Header.Get("Location")
		if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(loc, "/grup?") || !strings.Contains(loc, "avis=cap") {
			t.Fatalf("POST %s with nothing ticked: %d %q, want 303 to the group", p, resp.StatusCode, loc)
		}
		_, body := br.get(loc)
		if !strings.Contains(body, `id="none-ticked"`) || !strings.Contains(body, `<b id="group-count">2</b>`) {
			t.Fatalf("group page after %s with nothing ticked:\n%s", p, body)
		}
	}
	if n := b.pending(t); n != 2 {
		t.Fatalf("pending: %d, want 2", n)
	}
}
