package console_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/km0/km0/dlq"
)

// A confirmation acts on exactly the letters its dry run listed. The dry run
// lists 4 letters of a group; 2 more of the group die before the operator
// confirms; the job replays the 4 (total 4, republished 4), leaves the 2
// pending and says that 2 arrived since. Without a dry run's plan the
// confirmation is refused and nothing is replayed.
func TestReplayConfirmationActsOnTheLettersTheDryRunListed(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	b.produceDead(t, 4, class+": x")
	br := b.browser(t)
	csrf := br.login(token)
	sel := url.Values{"csrf": {csrf}, "abast": {"grup"}, "topic": {comandesDLQ}, "classe": {class}, "confirmo": {"1"}}
	if resp, _ := br.post("/reproduir", sel); resp.StatusCode != http.StatusConflict || b.records(t, comandesRetry) != 0 {
		t.Fatalf("confirmation without a dry run: %d, %d records; want 409 and none", resp.StatusCode, b.records(t, comandesRetry))
	}
	_, body := br.post("/reproduir/previsualitzar", sel)
	if !strings.Contains(body, `<b id="would">4</b>`) {
		t.Fatalf("dry run:\n%s", body)
	}
	sel.Set("pla", planOf(t, body))
	b.produceDead(t, 2, class+": y") // die after the dry run
	resp, _ := br.post("/reproduir", sel)
	loc := resp.Header.Get("Location")
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("replay: %d", resp.StatusCode)
	}
	st := br.waitJob(loc)

	if st.State != "done" || st.Total != 4 || st.Republished != 4 || st.Arrived != 2 {
		t.Fatalf("job: %+v; want 4 of 4 republished and 2 arrived since", st)
	}
	if p, r := b.pending(t), b.records(t, comandesRetry); p != 2 || r != 4 {
		t.Fatalf("after the replay: %d pending, %d republished; want 2 and 4", p, r)
	}
	if _, body := br.get(loc); !strings.Contains(body, `<p id="job-arrived"><b>2</b>`) {
		t.Fatalf("the job page does not say 2 letters arrived since:\n%s", body)
	}
	if resp, _ := br.post("/reproduir", sel); resp.StatusCode != http.StatusConflict {
		t.Fatalf("the same confirmation again: %d, want 409 (a plan is used once)", resp.StatusCode)
	}
	log, err := b.svc.AuditLog(b.ctx, dlq.AuditFilter{})
	if err != nil || len(log) != 1 || !strings.HasPrefix(log[0].Actor, "console:") || log[0].Action != dlq.ActionReplay ||
		len(log[0].Letters) != 4 || log[0].Result != "fet" {
		t.Fatalf("audit log: %+v %v; want one replay of 4 letters by the console session", log, err)
	}
}

// "Purge 4" purges 4: the confirmation page's count is a snapshot of IDs,
// and 2 letters arriving before the click stay pending, reported.
func TestPurgeConfirmationActsOnTheLettersItCounted(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	b.produceDead(t, 4, class+": x")
	br := b.browser(t)
	csrf := br.login(token)
	sel := url.Values{"csrf": {csrf}, "abast": {"grup"}, "topic": {comandesDLQ}, "classe": {class}}
	_, body := br.post("/purgar/confirmar", sel)
	if !strings.Contains(body, `<b id="purge-count">4</b>`) {
		t.Fatalf("confirmation page:\n%s", body)
	}
	sel.Set("pla", planOf(t, body))
	sel.Set("confirmo", "1")
	b.produceDead(t, 2, class+": y")
	_, body = br.post("/purgar", sel)
	if !strings.Contains(body, `<b id="purged">4</b>`) || !strings.Contains(body, `<p id="purge-arrived"><b>2</b>`) {
		t.Fatalf("purge result:\n%s", body)
	}
	if p := b.pending(t); p != 2 {
		t.Fatalf("pending after purging what the page counted: %d, want the 2 that arrived", p)
	}
}
