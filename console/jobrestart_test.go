package console_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/testkit"
)

// A paced replay job survives the console: 12 letters at 4 per second; the
// console's server is stopped once 3 are republished, and a new console on
// the same index resumes the job by itself. Each letter is republished
// exactly once (12 records, each letter replayed once), the audit log's
// entries of the two runs name each letter once, and a job can be cancelled
// while it runs (it stops before its next letter).
func TestReplayJobResumesAfterAConsoleRestartWithoutReplayingTwice(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	ids := b.produceDead(t, 12, class+": x")
	br := b.browser(t)
	csrf := br.login(token)
	sel := url.Values{"csrf": {csrf}, "abast": {"grup"}, "topic": {comandesDLQ}, "classe": {class}}
	_, body := br.post("/reproduir/previsualitzar", sel)
	if !strings.Contains(body, `id="replay-rate"`) {
		t.Fatalf("the dry run offers no pace:\n%s", body)
	}
	sel.Set("pla", planOf(t, body))
	sel.Set("confirmo", "1")
	sel.Set("per_segon", "4")
	resp, _ := br.post("/reproduir", sel)
	loc := resp.Header.Get("Location")
	if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(loc, "/feina?id=") {
		t.Fatalf("replay: %d %q", resp.StatusCode, loc)
	}
	jobID := strings.TrimPrefix(loc, "/feina?id=")
	status := func(br *browser) console.JobStatus {
		var st console.JobStatus
		_, body := br.get("/feina.json?id=" + jobID)
		if err := json.Unmarshal([]byte(body), &st); err != nil {
			t.Fatalf("job status: %v: %s", err, body)
		}
		return st
	}
	testkit.Eventually(t, 30*time.Second, "3 letters republished", func() bool { return status(br).Republished >= 3 })
	if st := status(br); st.State != "running" || st.Rate != 4 {
		t.Fatalf("job while it runs: %+v", st)
	}
	b.srv.Close() // the console's server goes away mid-job
	b.con.Close()
	st, err := b.svc.JobStatus(b.ctx, jobID)
	if err != nil || st.State != dlq.JobPending || st.Left == 0 || st.Done+st.Left+st.Refused != 12 {
		t.Fatalf("job after the console stopped: %+v %v; want pending with letters left", st, err)
	}
	t.Logf("console stopped with %d of 12 republished", st.Done)

	con, err := console.New(console.Config{Source: b.svc, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(con.Handler())
	t.Cleanup(func() { srv.Close(); con.Close() })
	b.srv = srv
	br = b.browser(t)
	br.login(token)
	testkit.Eventually(t, 30*time.Second, "the resumed job done", func() bool { return status(br).State == "done" })
	if st := status(br); st.Republished != 12 || st.Failed != 0 || st.Left != 0 {
		t.Fatalf("resumed job: %+v; want 12 republished", st)
	}
	if n := b.records(t, comandesRetry); n != 12 {
		t.Fatalf("%d records republished, want 12: each letter once", n)
	}
	for _, id := range ids {
		if l, err := b.svc.Get(b.ctx, id); err != nil || l.Replays != 1 {
			t.Fatalf("letter %s: %+v %v; want replayed once", id, l, err)
		}
	}
	log, err := b.svc.AuditLog(b.ctx, dlq.AuditFilter{})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, e := range log {
		for _, l := range e.Letters {
			seen[l]++
		}
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Fatalf("letter %s in %d audit entries, want 1: %+v", id, seen[id], log)
		}
	}

	// Cancelling: a new slow job stops before its next letter.
	more := b.produceDead(t, 6, class+": y")
	sel = url.Values{"csrf": {br.login(token)}, "abast": {"grup"}, "topic": {comandesDLQ}, "classe": {class}}
	_, body = br.post("/reproduir/previsualitzar", sel)
	sel.Set("pla", planOf(t, body))
	sel.Set("confirmo", "1")
	sel.Set("per_segon", "2")
	resp, _ = br.post("/reproduir", sel)
	jobID = strings.TrimPrefix(resp.Header.Get("Location"), "/feina?id=")
	testkit.Eventually(t, 30*time.Second, "the second job republishing", func() bool { return status(br).Republished >= 1 })
	if resp, _ := br.post("/feina/cancellar", url.Values{"id": {jobID}}); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("cancel without the form token: %d, want 403", resp.StatusCode)
	}
	if resp, _ := br.post("/feina/cancellar", url.Values{"id": {jobID}, "csrf": {sel.Get("csrf")}}); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("cancel: %d", resp.StatusCode)
	}
	testkit.Eventually(t, 30*time.Second, "the job cancelled", func() bool { st := status(br); return st.State == "cancelled" })
	js, err := b.svc.JobStatus(b.ctx, jobID)
	if err != nil || js.State != dlq.JobCancelled || js.Done >= len(more) {
		t.Fatalf("cancelled job: %+v %v; want cancelled before the end", js, err)
	}
}
