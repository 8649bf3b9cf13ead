package console_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/km0/km0/console"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
)

// waitJS polls the boolean expression js in the page until it holds, within
// 30 s (the pages refresh every few seconds).
func waitJS(t *testing.T, ctx context.Context, what, js string) {
	t.Helper()
	defer func() {
		if t.Failed() {
			t.Logf("browser: page: %q", clipText(eval[string](t, ctx, `document.body.innerText`), 600))
		}
	}()
	testkit.Eventually(t, 30*time.Second, "browser: "+what, func() bool { return eval[bool](t, ctx, js) })
}

// screenshot saves the page as an artifact. A screenshot is not an
// assertion: one that fails (a capture caught by a reload of the page never
// returns) is logged and the test goes on to its checks.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	png, err := chromedp.Run(sctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Logf("screenshot %s not saved: %v", name, err)
		return
	}
	saveArtifact(t, name, png)
}

// The operator's work in Chromium against a running service (cataleg,
// started by system.Start on the test's broker, with its own database): the
// failure groups by consumer with the consumer filter; a letter with its
// time headers as dates; the overview refreshing itself (a new letter shows
// without a reload, with the time of the refresh); nothing ticked leading
// back to the group; the blocked keys of the service's database; pausing
// cataleg's consumer group (its /salut, shown in the console's health, says
// so) and resuming it; a replay job. Screenshots go to $KM0_TEST_ARTIFACTS.
func TestBrowserOperations(t *testing.T) {
	t.Parallel()
	sampler := lag.NewSampler(lag.SamplerConfig{})
	now := time.Now()
	for i := 0; i <= 24; i++ {
		at := now.Add(time.Duration(i-24) * 150 * time.Second)
		burst := int64(0)
		if i == 20 {
			burst = 50
		}
		sampler.Add(&lag.Snapshot{At: at, Groups: []lag.GroupLag{{Group: "inventari.descompte_estoc", Total: int64(abs(12 - i))},
			{Group: "repartiment.assignacio", Total: burst}}, Outboxes: []lag.OutboxLag{{Name: "comandes", Pending: int64(i % 5)}}})
	}
	var sys *system.System
	b := setupWith(t, token, func(c *console.Config) { c.Sampler = sampler })
	sfx := make([]byte, 4)
	_, _ = rand.Read(sfx)
	suffix := "br" + hex.EncodeToString(sfx)
	sctx, stopSys := context.WithCancel(context.Background())
	var err error
	sys, err = system.Start(sctx, system.Config{DatabaseURL: pgtest.URL(), DatabaseSuffix: suffix, Brokers: b.brokers, Services: []string{cataleg.Name}, Logger: quietLog})
	if err != nil {
		stopSys()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stopSys()
		sys.Close()
		_ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName(cataleg.Name, suffix))
	})
	pool := sys.Pool(cataleg.Name)
	if _, err := migrate.Up(b.ctx, pool, migrate.Names{}, keyorder.Migrations); err != nil {
		t.Fatal(err)
	}
	ko, _ := keyorder.New(keyorder.Config{})
	tx, err := pool.Begin(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ko.MarkHeadBlocked(b.ctx, tx, cataleg.ConsumerLowStock, "formatge-curat", keyorder.Head{MessageID: "e-cap-7", Reason: keyorder.ReasonDeadLettered, LastError: "esquema: despres negatiu"}); err != nil {
		t.Fatal(err)
	}
	for i, id := range []string{"e-darrere-1", "e-darrere-2"} {
		if _, _, err := ko.Park(b.ctx, tx, cataleg.ConsumerLowStock, "formatge-curat", keyorder.Message{ID: id, Topic: "inventari.esdeveniments", Offset: int64(10 + i), Value: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(b.ctx); err != nil {
		t.Fatal(err)
	}
	// The console of the running system: its database and its health.
	con, err := console.New(console.Config{Source: b.svc, Token: token, Logger: quietLog, Sampler: sampler,
		Services:   []console.Service{{Name: cataleg.Name, URL: sys.Addrs()[cataleg.Name]}},
		ServiceDBs: []console.ServiceDB{{Name: cataleg.Name, DB: pool, Groups: sys.Groups(cataleg.Name)}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(con.Close)
	b.srv.Config.Handler = con.Handler()

	ids := b.produceDeadBy(t, 3, class+": falta adreca_lliurament", now, "inventari.descompte_estoc")
	b.produceDeadBy(t, 2, class+": falta adreca_lliurament", now, "repartiment.assignacio")
	b.produceDeadBy(t, 1, class2+": timeout after 5s", now, "repartiment.assignacio")
	ctx := newBrowser(t)
	base := b.srv.URL

	// Log in, the groups by consumer.
	step(t, ctx, "log in", chromedp.Navigate(base+"/login"), chromedp.WaitVisible(chromedp.CSS("#token")),
		chromedp.SendKeys(chromedp.CSS("#token"), token), chromedp.Click(chromedp.CSS("#login-submit")), chromedp.WaitVisible(chromedp.CSS("#logout")))
	step(t, ctx, "the overview", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#groups")))
	if n := eval[int](t, ctx, `document.querySelectorAll('tr.group[data-class="`+class+`"]').length`); n != 2 {
		t.Fatalf("groups of %q: %d, want 2 (one per consumer)", class, n)
	}
	if n := text(t, ctx, `tr.group[data-consumer="inventari.descompte_estoc"] .count`); n != "3" {
		t.Fatalf("inventari's group: %q, want 3", n)
	}
	screenshot(t, ctx, "01-groups-by-consumer.png")
	step(t, ctx, "filter by consumer", chromedp.SendKeys(chromedp.CSS("#filter-consumer"), "repartiment.assignacio"),
		chromedp.Click(chromedp.CSS("#filter-apply")), chromedp.WaitVisible(chromedp.CSS("#filter-clear")))
	if n := text(t, ctx, "#total"); n != "3" {
		t.Fatalf("filtered by repartiment.assignacio: total %q, want 3", n)
	}

	// The page refreshes itself: a new letter shows without a reload.
	step(t, ctx, "back to all", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#refreshed")))
	first := text(t, ctx, "#refreshed")
	b.produceDeadBy(t, 1, class+": falta adreca_lliurament", now, "inventari.descompte_estoc")
	waitJS(t, ctx, "the new letter on the refreshed overview", `(document.getElementById("total") || {}).textContent === "7"`)
	if n := text(t, ctx, `tr.group[data-consumer="inventari.descompte_estoc"] .count`); n != "4" || !strings.HasPrefix(text(t, ctx, "#refreshed"), "updated ") {
		t.Fatalf("after the refresh: inventari's group %q, stamp %q (was %q)", n, text(t, ctx, "#refreshed"), first)
	}

	// A letter: time headers as dates, the raw value on hover.
	step(t, ctx, "a letter", chromedp.Navigate(base+"/carta?id="+url.QueryEscape(ids[0])), chromedp.WaitVisible(chromedp.CSS("#headers")))
	if h := eval[string](t, ctx, `document.querySelector("#headers td.time").title`); h == "" {
		t.Fatal("no time header with its raw value on hover")
	}
	screenshot(t, ctx, "02-letter.png")

	// Nothing ticked: back to the group, which says so.
	step(t, ctx, "inventari's group", chromedp.Navigate(base+"/grup?topic="+comandesDLQ+"&consumidor=inventari.descompte_estoc&classe="+url.QueryEscape(class)),
		chromedp.WaitVisible(chromedp.CSS("#group-form")), chromedp.Click(chromedp.CSS("#replay-selected")), chromedp.WaitVisible(chromedp.CSS("#none-ticked")))

	// Replay inventari's group: the job.
	step(t, ctx, "dry run of inventari's group", chromedp.Click(chromedp.CSS("#replay-group")), chromedp.WaitVisible(chromedp.CSS("#confirm-replay")))
	if n := text(t, ctx, "#would"); n != "4" {
		t.Fatalf("dry run: %q, want 4 (inventari's letters only)", n)
	}
	step(t, ctx, "confirm", chromedp.Click(chromedp.CSS("#confirm-replay")), chromedp.WaitVisible(chromedp.CSS("#job")))
	waitJS(t, ctx, "the job done", `(document.getElementById("job") || {dataset: {}}).dataset.state === "done"`)
	// After the job ended: while it runs, the page reloads itself when the
	// state changes, and a capture caught by that reload never returns.
	screenshot(t, ctx, "03-replay-job-done.png")
	if n := b.pending(t); n != 3 {
		t.Fatalf("pending after replaying inventari's group: %d, want repartiment's 3", n)
	}

	// Blocked keys of the service's own database.
	step(t, ctx, "blocked keys", chromedp.Navigate(base+"/claus"), chromedp.WaitVisible(chromedp.CSS("#blocked")))
	if n := eval[int](t, ctx, `document.querySelectorAll('tr.blocked-key[data-service="cataleg"][data-key="formatge-curat"]').length`); n != 1 {
		t.Fatalf("cataleg's blocked key: %d rows", n)
	}
	screenshot(t, ctx, "04-blocked-keys.png")

	// Pause cataleg's group: the service says so in /salut, the console's
	// health shows it; then resume.
	step(t, ctx, "consumer groups", chromedp.Navigate(base+"/consumidors"), chromedp.WaitVisible(chromedp.CSS("#consumers")),
		chromedp.Click(chromedp.CSS(`tr[data-group="`+cataleg.ConsumerLowStock+`"] button.pause`)), chromedp.WaitVisible(chromedp.CSS("#done")))
	if p := eval[string](t, ctx, `document.querySelector('tr[data-group="`+cataleg.ConsumerLowStock+`"]').dataset.paused`); p != "true" {
		t.Fatalf("after the pause: paused %q", p)
	}
	screenshot(t, ctx, "05-consumer-paused.png")
	step(t, ctx, "health", chromedp.Navigate(base+"/lag"), chromedp.WaitVisible(chromedp.CSS("#health")))
	waitJS(t, ctx, "cataleg's health to say paused", `(document.getElementById("health") || {innerText: ""}).innerText.includes("paused: `+cataleg.ConsumerLowStock+`")`)
	screenshot(t, ctx, "06-lag-and-health-paused.png")
	step(t, ctx, "resume", chromedp.Navigate(base+"/consumidors"), chromedp.WaitVisible(chromedp.CSS("#consumers")),
		chromedp.Click(chromedp.CSS(`tr[data-group="`+cataleg.ConsumerLowStock+`"] button.resume`)), chromedp.WaitVisible(chromedp.CSS("#done")))
	if p := eval[string](t, ctx, `document.querySelector('tr[data-group="`+cataleg.ConsumerLowStock+`"]').dataset.paused`); p != "false" {
		t.Fatalf("after the resume: paused %q", p)
	}
	step(t, ctx, "health after the resume", chromedp.Navigate(base+"/lag?finestra=15m"), chromedp.WaitVisible(chromedp.CSS("#health")))
	waitJS(t, ctx, "cataleg's health to be plain ok", `((document.getElementById("health") || {innerText: "paused"}).innerText).includes("ok") && !(document.getElementById("health") || {innerText: "paused"}).innerText.includes("paused")`)
	if n := eval[int](t, ctx, `document.querySelectorAll("#lag-chart polyline").length`); n != 3 {
		t.Fatalf("15-minute chart: %d lines, want 3 (two groups and the outbox, all with lag in the window)", n)
	}
	screenshot(t, ctx, "07-lag-15m.png")
}

// The dead-letter operations in Chromium: the groups, a letter, its
// edit-and-replay form refusing an edit that breaks the schema (nothing
// sent), a paced replay (1 letter per second) in progress and then
// cancelled, the skip of a blocked head with its confirm step, the audit
// log with who did each, and a letter's attempt history. Screenshots go to $KM0_SCREENSHOTS (or
// $KM0_TEST_ARTIFACTS).
func TestBrowserDeadLetterOperations(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	head, behind := b.blockKey(t)
	now := time.Now()
	ids := b.produceDeadBy(t, 8, class+": falta adreca_lliurament", now, "repartiment.assignacio")
	b.produceDeadBy(t, 2, class2+": timeout after 5s", now, "inventari.descompte_estoc")
	ctx := newBrowser(t)
	base := b.srv.URL

	step(t, ctx, "log in", chromedp.Navigate(base+"/login"), chromedp.WaitVisible(chromedp.CSS("#token")),
		chromedp.SendKeys(chromedp.CSS("#token"), token), chromedp.Click(chromedp.CSS("#login-submit")), chromedp.WaitVisible(chromedp.CSS("#logout")))
	step(t, ctx, "the groups", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#groups")))
	screenshot(t, ctx, "dlqops-01-groups.png")

	step(t, ctx, "a letter", chromedp.Navigate(base+"/carta?id="+url.QueryEscape(ids[0])), chromedp.WaitVisible(chromedp.CSS("#edit-link")))
	screenshot(t, ctx, "dlqops-02-letter.png")
	step(t, ctx, "its edit form", chromedp.Click(chromedp.CSS("#edit-link")), chromedp.WaitVisible(chromedp.CSS("#edit-value")))
	if v := eval[string](t, ctx, `document.getElementById("edit-value").value`); !strings.Contains(v, `"mercat"`) {
		t.Fatalf("the edit form does not hold the envelope: %q", v)
	}
	screenshot(t, ctx, "dlqops-03-edit-form.png")
	before := b.records(t, comandesRetry)
	eval[bool](t, ctx, `(() => { const e = document.getElementById("edit-value"); e.value = e.value.replace('"mercat": "girona"', '"mercat": 7'); return true })()`)
	step(t, ctx, "send an edit that breaks the schema", chromedp.Click(chromedp.CSS("#edit-send")), chromedp.WaitVisible(chromedp.CSS("#edit-problem")))
	if n := b.records(t, comandesRetry); n != before {
		t.Fatalf("a refused edit published %d record(s)", n-before)
	}
	screenshot(t, ctx, "dlqops-04-edit-refused.png")

	// A paced replay of repartiment's group, in progress, then cancelled.
	step(t, ctx, "repartiment's group", chromedp.Navigate(base+"/grup?topic="+comandesDLQ+"&consumidor=repartiment.assignacio&classe="+url.QueryEscape(class)),
		chromedp.WaitVisible(chromedp.CSS("#group-form")), chromedp.Click(chromedp.CSS("#replay-group")), chromedp.WaitVisible(chromedp.CSS("#replay-rate")))
	eval[bool](t, ctx, `(() => { document.getElementById("replay-rate").value = "1"; return true })()`)
	step(t, ctx, "confirm at 1 letter per second", chromedp.Click(chromedp.CSS("#confirm-replay")), chromedp.WaitVisible(chromedp.CSS("#job")))
	waitJS(t, ctx, "the job under way", `(document.getElementById("job") || {dataset: {}}).dataset.state === "running" && Number((document.getElementById("republished") || {}).textContent) >= 2`)
	if r := text(t, ctx, "#job-rate"); r != "1" {
		t.Fatalf("job pace %q, want 1", r)
	}
	waitJS(t, ctx, "republished + refused + left = total on the page", `["republished", "failed", "job-left"].map(id => Number(document.getElementById(id).textContent)).reduce((a, b) => a + b) === 8`)
	screenshot(t, ctx, "dlqops-05-paced-replay-running.png")
	step(t, ctx, "cancel the job", chromedp.Click(chromedp.CSS("#job-cancel")), chromedp.WaitVisible(chromedp.CSS("#job")))
	waitJS(t, ctx, "the job cancelled", `(document.getElementById("job") || {dataset: {}}).dataset.state === "cancelled"`)
	if n := b.records(t, comandesRetry) - before; n >= 8 {
		t.Fatalf("%d letters republished by a job cancelled early, want fewer than 8", n)
	}
	screenshot(t, ctx, "dlqops-06-paced-replay-cancelled.png")

	// Skip the blocked head of P-2026-9, with its confirm step.
	step(t, ctx, "blocked keys", chromedp.Navigate(base+"/claus"), chromedp.WaitVisible(chromedp.CSS("#blocked")),
		chromedp.Click(chromedp.CSS(`tr.blocked-key[data-key="P-2026-9"] button.skip-head`)), chromedp.WaitVisible(chromedp.CSS("#skip-confirm")))
	if h := text(t, ctx, "#skip-head"); h != "e-cap" {
		t.Fatalf("skip confirm of head %q, want e-cap", h)
	}
	step(t, ctx, "the reason", chromedp.SendKeys(chromedp.CSS("#skip-reason"), "v1 comanda.pagada without an address: can never succeed"))
	screenshot(t, ctx, "dlqops-07-skip-confirm.png")
	step(t, ctx, "skip", chromedp.Click(chromedp.CSS("#skip-confirm")), chromedp.WaitVisible(chromedp.CSS("#skip-next")))
	if n := text(t, ctx, "#skip-next"); n != behind {
		t.Fatalf("replayed %q after the skip, want %s", n, behind)
	}
	screenshot(t, ctx, "dlqops-08-skipped.png")

	step(t, ctx, "the audit log", chromedp.Navigate(base+"/auditoria"), chromedp.WaitVisible(chromedp.CSS("#audit")))
	waitJS(t, ctx, "the skip and the job's run in the audit log", `document.querySelectorAll('tr.audit-entry[data-action="salt"]').length === 1 && document.querySelectorAll('tr.audit-entry[data-action="reproduccio"]').length >= 2`)
	if !strings.Contains(eval[string](t, ctx, `document.getElementById("audit").innerText`), head) {
		t.Fatalf("the audit log does not name the skipped head's letter %s", head)
	}
	screenshot(t, ctx, "dlqops-09-audit-log.png")

	// A letter with its attempt history (historial_intents).
	hist := b.produceWithHistory(t)
	step(t, ctx, "a letter with its attempt history", chromedp.Navigate(base+"/carta?id="+url.QueryEscape(hist)), chromedp.WaitVisible(chromedp.CSS("#history")))
	if h := eval[string](t, ctx, `document.getElementById("history").innerText`); !strings.Contains(h, "<script>alert(1)</script>") || !strings.Contains(h, "2026-03-01 10:03:00Z") {
		t.Fatalf("the attempt history on the page: %q", h)
	}
	screenshot(t, ctx, "dlqops-10-attempt-history.png")
}
