package console_test

import (
	"cmp"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/km0/km0/console"
	"github.com/km0/km0/lag"
)

func abs(n int) int { return max(n, -n) }

// chromiumPath is Debian's Chromium (apt-get install chromium).
const chromiumPath = "/usr/bin/chromium"

// newBrowser starts a headless Chromium with a fresh profile, stopped at
// cleanup. Without Chromium the test is skipped, except in CI (CI=true),
// where that is a failure naming the package to install.
func newBrowser(t *testing.T) context.Context {
	t.Helper()
	if _, err := exec.LookPath(chromiumPath); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s is missing: install Debian's chromium (apt-get install -y chromium chromium-driver)", chromiumPath)
		}
		t.Skipf("%s is missing: install Debian's chromium to run the browser test", chromiumPath)
	}
	// Not t.TempDir: Chromium's child processes may still write to the
	// profile for a moment after the browser stops, and RemoveAll must be
	// tried again then.
	profile, err := os.MkdirTemp("", "km0-console-chromium-")
	if err != nil {
		t.Fatal(err)
	}
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(chromiumPath), chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.NoFirstRun, chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.Flag("disable-quic", true),
		chromedp.UserDataDir(profile), chromedp.WindowSize(1280, 1000))
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
		deadline := time.Now().Add(10 * time.Second)
		for err := os.RemoveAll(profile); err != nil; err = os.RemoveAll(profile) {
			if time.Now().After(deadline) {
				t.Errorf("remove the browser profile %s: %v", profile, err)
				return
			}
			time.Sleep(50 * time.Millisecond) // retry interval
		}
	})
	if err := chromedp.Do(ctx); err != nil { // starts the browser (no timeout on this first call)
		t.Fatalf("start %s: %v", chromiumPath, err)
	}
	return ctx
}

// step runs actions within a bound, failing the test with what it was doing.
func step(t *testing.T, ctx context.Context, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(sctx, actions...); err != nil {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		loc, _ := chromedp.Run(lctx, chromedp.Location())
		body, _ := chromedp.Run(lctx, chromedp.Evaluate[string](`document.body ? document.body.innerText : ""`))
		t.Fatalf("browser: %s: %v (at %s, showing %q)", what, err, loc, clipText(body, 600))
	}
}

// text is the text of the element sel selects, read in the page in one
// step: a page that refreshes itself replaces its live parts, and a
// node-by-node read (chromedp.Text) can find a node that is gone when it
// asks for its text.
func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	q, _ := json.Marshal(sel)
	s := eval[*string](t, ctx, `(e => e ? e.innerText : null)(document.querySelector(`+string(q)+`))`)
	if s == nil {
		t.Fatalf("browser: no element %s", sel)
	}
	return strings.TrimSpace(*s)
}

func eval[T any](t *testing.T, ctx context.Context, js string) T {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	v, err := chromedp.Run(sctx, chromedp.Evaluate[T](js))
	if err != nil {
		t.Fatalf("browser: %s: %v", js, err)
	}
	return v
}

// The console in a real browser: without the token it shows counts and no
// way to read a letter or act; logged in, an operator finds the group with
// its count, replays it (dry run, then for real) and sees the count fall.
func TestBrowserReplayGroup(t *testing.T) {
	t.Parallel()
	// A lag history for the chart of the screenshot: one group falling
	// behind and catching up over the last hour, and a healthy service.
	sampler := lag.NewSampler(lag.SamplerConfig{})
	for i := 0; i <= 12; i++ {
		behind := int64(40 * (6 - abs(i-6)))
		sampler.Add(&lag.Snapshot{At: time.Now().Add(time.Duration(i-12) * 5 * time.Minute),
			Groups:   []lag.GroupLag{{Group: "repartiment.assignacio", Total: behind}},
			Outboxes: []lag.OutboxLag{{Name: "comandes", Pending: behind / 4}}})
	}
	health := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"servei":"comandes","estat":"ok"}`))
	}))
	defer health.Close()
	b := setupWith(t, token, func(c *console.Config) {
		c.Sampler = sampler
		c.Services = []console.Service{{Name: "comandes", URL: health.URL}}
	})
	ids := b.produceDead(t, 3, class+": falta adreca_lliurament")
	b.produceDead(t, 2, class2+": timeout after 5s")
	ctx := newBrowser(t)
	base := b.srv.URL
	row := func(c string) string { return `tr.group[data-class="` + c + `"]` }

	// Logged out: counts, and neither contents nor actions.
	step(t, ctx, "open the overview", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#groups")))
	if n := text(t, ctx, row(class)+" .count"); n != "3" {
		t.Fatalf("logged out: group count %q, want 3", n)
	}
	if n := eval[int](t, ctx, `document.querySelectorAll("a.group-link, form[action^='/reproduir'], button[formaction]").length`); n != 0 {
		t.Fatalf("logged out: %d links or actions on the overview", n)
	}
	step(t, ctx, "open a letter logged out", chromedp.Navigate(base+"/carta?id="+url.QueryEscape(ids[0])), chromedp.WaitVisible(chromedp.CSS("#login-form")))
	if body := eval[string](t, ctx, `document.body.innerText`); strings.Contains(body, customer) {
		t.Fatal("logged out: the letter's contents are shown")
	}

	// Log in (the form sends back to the letter asked for).
	step(t, ctx, "log in", chromedp.SendKeys(chromedp.CSS("#token"), token), chromedp.Click(chromedp.CSS("#login-submit")),
		chromedp.WaitVisible(chromedp.CSS("#envelope")))
	if body := text(t, ctx, "#envelope"); !strings.Contains(body, customer) {
		t.Fatalf("logged in: envelope %q lacks the order", body)
	}

	// Find the group, dry-run it, confirm, follow the job.
	step(t, ctx, "open the group", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#logout")),
		chromedp.Click(chromedp.CSS(row(class)+" a.group-link")), chromedp.WaitVisible(chromedp.CSS("#group-form")))
	if n := text(t, ctx, "#group-count"); n != "3" {
		t.Fatalf("group page count %q, want 3", n)
	}
	step(t, ctx, "dry run", chromedp.Click(chromedp.CSS("#replay-group")), chromedp.WaitVisible(chromedp.CSS("#confirm-replay")))
	if n := text(t, ctx, "#would"); n != "3" {
		t.Fatalf("dry run would replay %q, want 3", n)
	}
	if n := b.pending(t); n != 5 {
		t.Fatalf("the dry run changed the index: %d pending", n)
	}
	step(t, ctx, "confirm the replay", chromedp.Click(chromedp.CSS("#confirm-replay")),
		chromedp.WaitVisible(chromedp.CSS(`#job[data-state="done"]`)))
	if r, f := text(t, ctx, "#republished"), text(t, ctx, "#failed"); r != "3" || f != "0" {
		t.Fatalf("job: %s republished, %s failed; want 3 and 0", r, f)
	}

	// The count fell: the group is gone from the pending ones, the other stays.
	step(t, ctx, "back to the overview", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#groups")))
	if n := eval[int](t, ctx, `document.querySelectorAll('`+row(class)+`').length`); n != 0 {
		t.Fatalf("the replayed group is still pending")
	}
	if n := text(t, ctx, row(class2)+" .count"); n != "2" {
		t.Fatalf("the other group: %q, want 2", n)
	}
	if n := eval[int](t, ctx, `document.querySelectorAll("#lag-chart polyline").length`); n != 2 {
		t.Fatalf("lag chart: %d lines, want 2", n)
	}
	if total := text(t, ctx, "#total"); total != "2" {
		t.Fatalf("total %q, want 2", total)
	}
	if n := b.records(t, comandesRetry); n != 3 || b.pending(t) != 2 {
		t.Fatalf("after the replay: %d records on %s, %d pending; want 3 and 2", n, comandes, b.pending(t))
	}
	screenshot(t, ctx, "console-after-replay.png")

	// Logged out again: no sample, no links.
	step(t, ctx, "log out", chromedp.Click(chromedp.CSS("#logout")), chromedp.WaitVisible(chromedp.CSS("#login-link")))
	if n := eval[int](t, ctx, `document.querySelectorAll("a.group-link, a[href^='/carta']").length`); n != 0 {
		t.Fatalf("after logout: %d links to letters or groups", n)
	}
}

// saveArtifact writes a test artifact to $KM0_TEST_ARTIFACTS (default
// <tmp>/km0-test-artifacts) and logs its path.
func saveArtifact(t *testing.T, name string, data []byte) {
	t.Helper()
	dir := cmp.Or(os.Getenv("KM0_SCREENSHOTS"), os.Getenv("KM0_TEST_ARTIFACTS"))
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "km0-test-artifacts")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("artifacts: %v", err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatalf("artifacts: %v", err)
	}
	t.Logf("screenshot saved: %s", p)
}

func clipText(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
