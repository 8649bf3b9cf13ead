package console_test

import (
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"
)

// total is the overview's letter count.
func total(t *testing.T, body string) string {
	t.Helper()
	m := regexp.MustCompile(`<b id="total">(\d+)</b>`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no total on the page:\n%s", body)
	}
	return m[1]
}

// The overview's filter form is the CLI's selection (--topic, --motiu,
// --since, --until) through the same dlq.Filter: it narrows the groups and
// their counts, the group pages it links to, and the replay and purge of a
// group or of everything it selects. An age is resolved once, so the dry
// run, the confirmation and the job select the same letters. A motiu prefix
// needs the login (reasons hold customer data); a filter never selects
// every letter.
func TestFilterFormNarrowsGroupsAndActions(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	now := time.Now()
	b.produceDeadAt(t, 3, class+": falta adreca_lliurament", now.Add(-3*time.Hour))
	b.produceDeadAt(t, 2, class+": falta telefon", now.Add(-30*time.Minute))
	b.produceDeadAt(t, 1, "transitori esgotat: timeout", now.Add(-30*time.Minute))
	br := b.browser(t)

	// Without login: time bounds and topics narrow the counts; a motiu
	// prefix is refused and shows no count.
	if _, body := br.get("/?des_de=1h"); total(t, body) != "3" || !strings.Contains(body, `<td class="num count">2</td>`) {
		t.Fatalf("des_de=1h without login:\n%s", body)
	}
	if _, body := br.get("/?fins_a=1h&topic=" + comandes); total(t, body) != "3" {
		t.Fatalf("fins_a=1h, original topic, without login:\n%s", body)
	}
	if resp, body := br.get("/?motiu=" + url.QueryEscape(class+": falta a")); resp.StatusCode != http.StatusUnauthorized || strings.Contains(body, `id="total"`) {
		t.Fatalf("motiu without login: %d\n%s", resp.StatusCode, body)
	}
	if resp, body := br.get("/?des_de=yesterday"); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "des_de") {
		t.Fatalf("bad des_de: %d\n%s", resp.StatusCode, body)
	}
	if resp, _ := br.get("/?des_de=1h&fins_a=2h"); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("fins_a before des_de: %d, want 400", resp.StatusCode)
	}

	csrf := br.login(token)
	_, body := br.get("/?motiu=" + url.QueryEscape(class+": falta a"))
	if total(t, body) != "3" || !strings.Contains(body, `id="filter-form"`) || !strings.Contains(body, `id="replay-filter"`) {
		t.Fatalf("motiu prefix, logged in:\n%s", body)
	}
	_, body = br.get("/?des_de=1h&motiu=" + url.QueryEscape(class))
	if total(t, body) != "2" {
		t.Fatalf("des_de=1h and the class as motiu prefix:\n%s", body)
	}
	// The group link carries the filter, with the age as an absolute time.
	link := regexp.MustCompile(`class="group-link" href="([^"]+)"`).FindStringSubmatch(body)
	if link == nil || !strings.Contains(link[1], "des_de=") || strings.Contains(link[1], "des_de=1h") {
		t.Fatalf("group link: %v", link)
	}
	href := strings.ReplaceAll(link[1], "&amp;", "&")
	if _, body := br.get(href); !strings.Contains(body, `<b id="group-count">2</b>`) || !strings.Contains(body, `name="des_de" value="`) {
		t.Fatalf("group page through the filtered link %s:\n%s", href, body)
	}

	// A filter with no condition selects nothing.
	if resp, _ := br.post("/reproduir/previsualitzar", url.Values{"csrf": {csrf}, "abast": {"filtre"}}); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("empty filter: %d, want 400", resp.StatusCode)
	}
	// Replay what the filter selects: the 2 recent letters of the class.
	sel := url.Values{"csrf": {csrf}, "abast": {"filtre"}, "motiu": {class}, "des_de": {"1h"}}
	_, body = br.post("/reproduir/previsualitzar", sel)
	sel.Set("pla", planOf(t, body))
	if !strings.Contains(body, `<b id="would">2</b>`) || b.pending(t) != 6 {
		t.Fatalf("dry run of the filter:\n%s", body)
	}
	since := regexp.MustCompile(`name="des_de" value="([^"]+)"`).FindStringSubmatch(body)
	if since == nil {
		t.Fatalf("the confirmation does not carry des_de:\n%s", body)
	}
	if _, err := time.Parse(time.RFC3339Nano, since[1]); err != nil {
		t.Fatalf("des_de carried as %q, want an absolute time", since[1])
	}
	sel.Set("des_de", since[1])
	sel.Set("confirmo", "1")
	resp, _ := br.post("/reproduir", sel)
	loc := resp.Header.Get("Location")
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("replay: %d", resp.StatusCode)
	}
	st := br.waitJob(loc)

	if st.State != "done" || st.Total != 2 || st.Republished != 2 || !strings.Contains(st.Selection, "dead at or after") {
		t.Fatalf("job: %+v", st)
	}
	if n, r := b.pending(t), b.records(t, comandesRetry); n != 4 || r != 2 {
		t.Fatalf("after the filtered replay: %d pending, %d republished; want 4 and 2", n, r)
	}

	// Purge a group narrowed by fins_a: only its 3 old letters.
	g := url.Values{"csrf": {csrf}, "abast": {"grup"}, "topic": {comandesDLQ}, "classe": {class}, "fins_a": {"1h"}}
	_, body = br.post("/purgar/confirmar", g)
	g.Set("pla", planOf(t, body))
	if !strings.Contains(body, `<b id="purge-count">3</b>`) {
		t.Fatalf("purge confirmation of the narrowed group:\n%s", body)
	}
	g.Set("confirmo", "1")
	if _, body := br.post("/purgar", g); !strings.Contains(body, `<b id="purged">3</b>`) {
		t.Fatalf("purge of the narrowed group:\n%s", body)
	}
	if n := b.pending(t); n != 1 {
		t.Fatalf("pending after the purge: %d, want the transient letter only", n)
	}
}
