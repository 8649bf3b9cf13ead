package console_test

import (
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
)

// copies writes two copies of one letter (one event dead twice in consumer
// repartiment, a second apart, as after a crash) and one other letter of the
// same group, syncs the index, and returns the copies, oldest first, and the
// other letter.
func (b *bundle) copies(t *testing.T, i int) (older, newer, other string) {
	t.Helper()
	eid, now := uuid.NewString(), time.Now()
	older = b.deadLetter(t, eid, i, class+": x", now.Add(-time.Second), "repartiment")
	newer = b.deadLetter(t, eid, i, class+": x", now, "repartiment")
	other = b.deadLetter(t, uuid.NewString(), i+1, class+": x", now, "repartiment")
	if _, err := b.svc.Sync(b.ctx); err != nil {
		t.Fatal(err)
	}
	return older, newer, other
}

// groupRows are the rows of a group page: letter id → its copies column.
func groupRows(body string) map[string]string {
	rows := map[string]string{}
	for _, m := range regexp.MustCompile(`<tr class="letter" data-id="([^"]+)">[\s\S]*?<td class="num copies">(\d+)</td>`).FindAllStringSubmatch(body, -1) {
		rows[m[1]] = m[2]
	}
	return rows
}

// The group page folds duplicate letters (the same event dead in the same
// consumer, dlq.Filter.Fold as `km0 dlq ls`): two copies of one letter are
// one row, the newer copy's, with 2 in the copies column, and the count
// still counts 3 letters. A row stands for all its copies: purging the
// ticked row purges both copies (the confirm page counts 2, 1 of them a
// copy), and leaves the other letter pending.
func TestGroupPageFoldsDuplicateLetters(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	older, newer, other := b.copies(t, 0)
	br := b.browser(t)
	csrf := br.login(token)
	_, body := br.get("/grup?topic=" + comandesDLQ + "&consumidor=repartiment&classe=" + url.QueryEscape(class))
	rows := groupRows(body)
	if len(rows) != 2 || rows[newer] != "2" || rows[other] != "1" || !strings.Contains(body, `<b id="group-count">3</b>`) ||
		!strings.Contains(body, `<b id="folded">1</b>`) || strings.Contains(body, `, the first`) {
		t.Fatalf("group page with two copies of one letter: rows %v\n%s", rows, body)
	}
	sel := url.Values{"csrf": {csrf}, "abast": {"seleccio"}, "topic": {comandesDLQ}, "consumidor": {"repartiment"}, "classe": {class},
		"id": {newer}}
	_, body = br.post("/purgar/confirmar", sel)
	if !strings.Contains(body, `<b id="purge-count">2</b>`) || !strings.Contains(body, `<b id="purge-copies">1</b>`) {
		t.Fatalf("purge confirmation of a folded row:\n%s", body)
	}
	sel.Set("pla", planOf(t, body))
	sel.Set("confirmo", "1")
	_, body = br.post("/purgar", sel)
	if !strings.Contains(body, `<b id="purged">2</b>`) || strings.Contains(body, `id="purge-arrived"`) {
		t.Fatalf("purge of a folded row:\n%s", body)
	}
	for id, want := range map[string]dlq.State{older: dlq.StatePurged, newer: dlq.StatePurged, other: dlq.StatePending} {
		if l, err := b.svc.Get(b.ctx, id); err != nil || l.State != want {
			t.Fatalf("letter %s after purging the folded row: %v %v, want %s", id, l, err, want)
		}
	}
}

// Replaying a folded row replays one copy (the consumer gets the event once,
// and one is enough) and marks the other copy purged when the replay is
// confirmed: the dry run says so and the job's page counts it. The group's
// replay folds the same way: of its 4 pending letters of 3 events, 3 are
// replayed and the copy is purged.
func TestReplayOfAFoldedRowReplaysOneCopy(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	older, newer, other := b.copies(t, 0)
	br := b.browser(t)
	csrf := br.login(token)
	replay := func(sel url.Values, would, copies, total int) console.JobStatus {
		t.Helper()
		_, body := br.post("/reproduir/previsualitzar", sel)
		if !strings.Contains(body, `<b id="would">`+itoa(would)+`</b>`) || !strings.Contains(body, `<b id="copies">`+itoa(copies)+`</b>`) ||
			!strings.Contains(body, `<code class="copy-id">`+older+`</code>`) {
			t.Fatalf("dry run: want %d to replay and %d copy\n%s", would, copies, body)
		}
		if n := b.pending(t); n != total {
			t.Fatalf("the dry run changed the index: %d pending, want %d", n, total)
		}
		sel.Set("pla", planOf(t, body))
		sel.Set("confirmo", "1")
		resp, _ := br.post("/reproduir", sel)
		loc := resp.Header.Get("Location")
		if resp.StatusCode != http.StatusSeeOther {
			t.Fatalf("replay: %d", resp.StatusCode)
		}
		st := br.waitJob(loc)
		if _, body := br.get(loc); !strings.Contains(body, `<p id="job-copies"><b>`+itoa(copies)+`</b>`) {
			t.Fatalf("the job page does not count the copy:\n%s", body)
		}
		return st
	}

	// The ticked row: the newer copy is replayed, the older one purged.
	st := replay(url.Values{"csrf": {csrf}, "abast": {"seleccio"}, "topic": {comandesDLQ}, "consumidor": {"repartiment"},
		"classe": {class}, "id": {newer}}, 1, 1, 3)
	if st.State != "done" || st.Total != 1 || st.Republished != 1 || st.Copies != 1 || b.records(t, comandesRetry) != 1 {
		t.Fatalf("job of a folded row: %+v, %d record(s); want the event replayed once", st, b.records(t, comandesRetry))
	}
	for id, want := range map[string]dlq.State{older: dlq.StatePurged, newer: dlq.StateReplayed, other: dlq.StatePending} {
		if l, err := b.svc.Get(b.ctx, id); err != nil || l.State != want {
			t.Fatalf("letter %s after replaying the folded row: %v %v, want %s", id, l, err, want)
		}
	}

	// The group: two more copies of one event beside the other letter.
	older, _, _ = b.copies(t, 5)
	st = replay(url.Values{"csrf": {csrf}, "abast": {"grup"}, "topic": {comandesDLQ}, "consumidor": {"repartiment"},
		"classe": {class}}, 3, 1, 4)
	if st.State != "done" || st.Total != 3 || st.Republished != 3 || b.records(t, comandesRetry) != 4 || b.pending(t) != 0 {
		t.Fatalf("group job: %+v, %d record(s), %d pending; want 3 more records (one per event) and nothing pending",
			st, b.records(t, comandesRetry), b.pending(t))
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
