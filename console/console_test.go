package console_test

import (
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
)

const (
	class  = "permanent: esquema"
	class2 = "transitori esgotat: xarxa"
)

// Without a session the overview shows the failure groups with their counts
// and nothing of the letters; letter pages and group pages send to the
// login form; every action answers 401 and changes nothing.
func TestWithoutLoginCountsOnly(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	ids := b.produceDead(t, 3, class+": falta adreca_lliurament")
	br := b.browser(t)
	resp, body := br.get("/")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /: %d", resp.StatusCode)
	}
	if !regexp.MustCompile(`<td class="num count">3</td>`).MatchString(body) || !strings.Contains(body, class) {
		t.Fatalf("overview lacks the group with count 3:\n%s", body)
	}
	for _, secret := range []string{customer, ids[0], "falta adreca_lliurament", "/carta?", "/grup?"} {
		if strings.Contains(body, secret) {
			t.Errorf("overview without login shows %q", secret)
		}
	}
	for _, p := range []string{"/carta?id=" + url.QueryEscape(ids[0]), "/grup?topic=" + comandesDLQ + "&classe=" + url.QueryEscape(class)} {
		resp, body := br.get(p)
		if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(resp.Header.Get("Location"), "/login") {
			t.Errorf("GET %s without login: %d %s, want 303 to /login", p, resp.StatusCode, resp.Header.Get("Location"))
		}
		if strings.Contains(body, customer) {
			t.Errorf("GET %s without login shows customer data", p)
		}
	}
	sel := url.Values{"abast": {"grup"}, "topic": {comandesDLQ}, "classe": {class}, "confirmo": {"1"}}
	for _, p := range []string{"/reproduir/previsualitzar", "/reproduir", "/purgar/confirmar", "/purgar"} {
		if resp, _ := br.post(p, sel); resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("POST %s without login: %d, want 401", p, resp.StatusCode)
		}
	}
	if n := b.pending(t); n != 3 {
		t.Fatalf("pending letters after refused actions: %d, want 3", n)
	}
	if n := b.records(t, comandesRetry); n != 0 {
		t.Fatalf("records republished by refused actions: %d, want 0", n)
	}
}

// With no token configured nobody can log in: counts only.
func TestNoTokenConfigured(t *testing.T) {
	t.Parallel()
	b := setup(t, "")
	ids := b.produceDead(t, 2, class+": x")
	br := b.browser(t)
	_, body := br.get("/")
	if !strings.Contains(body, `id="counts-only"`) || !strings.Contains(body, `<td class="num count">2</td>`) {
		t.Fatalf("overview without token:\n%s", body)
	}
	if resp, _ := br.post("/login", url.Values{"token": {""}}); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("POST /login with no token configured: %d, want 403", resp.StatusCode)
	}
	if resp, body := br.get("/carta?id=" + url.QueryEscape(ids[0])); resp.StatusCode != http.StatusForbidden || strings.Contains(body, customer) {
		t.Fatalf("GET /carta with no token configured: %d", resp.StatusCode)
	}
	if resp, _ := br.post("/reproduir", url.Values{"abast": {"grup"}, "topic": {comandesDLQ}, "classe": {class}, "confirmo": {"1"}}); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("POST /reproduir with no token configured: %d, want 403", resp.StatusCode)
	}
	if n := b.pending(t); n != 2 {
		t.Fatalf("pending: %d, want 2", n)
	}
}

// A wrong token is refused; the right one opens an HttpOnly SameSite=Strict
// session; a POST without the session's CSRF token, or from another origin,
// is refused.
func TestLoginSessionAndCSRF(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	ids := b.produceDead(t, 1, class+": x")
	br := b.browser(t)
	if resp, body := br.post("/login", url.Values{"token": {"wrong"}}); resp.StatusCode != http.StatusUnauthorized || !strings.Contains(body, "wrong token") {
		t.Fatalf("wrong token: %d", resp.StatusCode)
	}
	if strings.Contains(b.logs.String(), "wrong\"") || strings.Contains(b.logs.String(), token) {
		t.Fatal("the log holds a token")
	}
	resp, _ := br.post("/login", url.Values{"token": {token}, "next": {"//evil.example/"}})
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/" {
		t.Fatalf("login: %d to %q, want 303 to / (never another host)", resp.StatusCode, resp.Header.Get("Location"))
	}
	ck := resp.Header.Get("Set-Cookie")
	for _, want := range []string{console.CookieName + "=", "HttpOnly", "SameSite=Strict", "Path=/"} {
		if !strings.Contains(ck, want) {
			t.Errorf("session cookie %q lacks %s", ck, want)
		}
	}
	_, page := br.get("/")
	csrf := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(page)[1]
	// Logged in, the letter's page shows its envelope.
	resp, body := br.get("/carta?id=" + url.QueryEscape(ids[0]))
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, customer) || !strings.Contains(body, "repartiment") {
		t.Fatalf("letter page: %d\n%s", resp.StatusCode, body)
	}
	sel := url.Values{"abast": {"seleccio"}, "id": {ids[0]}}
	if resp, _ := br.post("/reproduir/previsualitzar", sel); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("POST without csrf: %d, want 403", resp.StatusCode)
	}
	wrong := "x"
	if csrf[0] == 'x' { // the right token may begin with x (1 in 16 or 64)
		wrong = "y"
	}
	sel.Set("csrf", wrong+csrf[1:])
	if resp, _ := br.post("/reproduir/previsualitzar", sel); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("POST with a wrong csrf: %d, want 403", resp.StatusCode)
	}
	sel.Set("csrf", csrf)
	if resp, _ := br.do(http.MethodPost, "/reproduir/previsualitzar", sel, "Origin", "http://evil.example"); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("cross-origin POST: %d, want 403", resp.StatusCode)
	}
	if resp, body := br.post("/reproduir/previsualitzar", sel); resp.StatusCode != http.StatusOK || !strings.Contains(body, `<b id="would">1</b>`) {
		t.Fatalf("dry run: %d\n%s", resp.StatusCode, body)
	}
	if n := b.pending(t); n != 1 {
		t.Fatalf("a dry run changed the index: %d pending", n)
	}
	// After logout the session is gone.
	if resp, _ := br.post("/logout", url.Values{"csrf": {csrf}}); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("logout: %d", resp.StatusCode)
	}
	if resp, _ := br.post("/reproduir/previsualitzar", sel); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("POST after logout: %d, want 401", resp.StatusCode)
	}
}

// Replaying a group: the dry run changes nothing, the confirmed replay runs
// as a job whose status ends with every letter republished, and the group's
// pending count falls to zero.
func TestReplayGroupJob(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	b.produceDead(t, 250, class+": x")
	b.produceDead(t, 2, "transitori esgotat: timeout")
	br := b.browser(t)
	csrf := br.login(token)
	sel := url.Values{"csrf": {csrf}, "abast": {"grup"}, "topic": {comandesDLQ}, "classe": {class}}
	_, body := br.post("/reproduir/previsualitzar", sel)
	sel.Set("pla", planOf(t, body))
	if !strings.Contains(body, `<b id="would">250</b>`) || b.pending(t) != 252 {
		t.Fatalf("dry run: pending %d\n%s", b.pending(t), body)
	}
	if resp, _ := br.post("/reproduir", sel); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("replay without confirmo: %d, want 400", resp.StatusCode)
	}
	sel.Set("confirmo", "1")
	resp, _ := br.post("/reproduir", sel)
	loc := resp.Header.Get("Location")
	if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(loc, "/feina?id=") {
		t.Fatalf("replay: %d %q", resp.StatusCode, loc)
	}
	st := br.waitJob(loc)

	if st.State != "done" || st.Total != 250 || st.Republished != 250 || st.Failed != 0 {
		t.Fatalf("job: %+v", st)
	}
	if n := b.pending(t); n != 2 {
		t.Fatalf("pending after the replay: %d, want the 2 of the other group", n)
	}
	if n := b.records(t, comandesRetry); n != 250 {
		t.Fatalf("records on %s: %d, want 250", comandes, n)
	}
	_, body = br.get("/")
	if strings.Contains(body, `data-class="`+class+`"`) {
		t.Fatal("the replayed group is still listed as pending")
	}
}

// Purging a selection asks for confirmation with the count, then marks
// exactly the selected letters purged.
func TestPurgeSelection(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	ids := b.produceDead(t, 3, class+": x")
	br := b.browser(t)
	csrf := br.login(token)
	sel := url.Values{"csrf": {csrf}, "abast": {"seleccio"}, "id": {ids[0], ids[2]}}
	_, body := br.post("/purgar/confirmar", sel)
	sel.Set("pla", planOf(t, body))
	if !strings.Contains(body, `<b id="purge-count">2</b>`) || b.pending(t) != 3 {
		t.Fatalf("confirmation page:\n%s", body)
	}
	if resp, _ := br.post("/purgar", sel); resp.StatusCode != http.StatusBadRequest || b.pending(t) != 3 {
		t.Fatalf("purge without confirmo: %d", resp.StatusCode)
	}
	sel.Set("confirmo", "1")
	_, body = br.post("/purgar", sel)
	if !strings.Contains(body, `<b id="purged">2</b>`) {
		t.Fatalf("purge result:\n%s", body)
	}
	l, err := b.svc.Get(b.ctx, ids[1])
	if err != nil || l.State != dlq.StatePending || b.pending(t) != 1 {
		t.Fatalf("after purging 2 of 3: pending %d, the unselected one %v %v", b.pending(t), l.State, err)
	}
}

// Bad input is a 400 and a failing index a 503, neither with internals.
func TestErrorsWithoutInternals(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	b.produceDead(t, 1, class+": x")
	br := b.browser(t)
	csrf := br.login(token)
	resp, body := br.get("/grup?topic=%00&classe=x")
	if resp.StatusCode != http.StatusBadRequest || strings.Contains(body, "SQLSTATE") {
		t.Fatalf("NUL topic: %d %s", resp.StatusCode, body)
	}
	resp, body = br.post("/reproduir/previsualitzar", url.Values{"csrf": {csrf}, "abast": {"seleccio"}, "id": {"a\x00b"}})
	if resp.StatusCode != http.StatusBadRequest || strings.Contains(body, "SQLSTATE") {
		t.Fatalf("NUL id: %d %s", resp.StatusCode, body)
	}
	if resp, _ := br.post("/reproduir/previsualitzar", url.Values{"csrf": {csrf}, "abast": {"seleccio"}}); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("empty selection: %d, want 400", resp.StatusCode)
	}
	b.schema.Pool.Close() // the index goes away
	resp, body = br.get("/grup?topic=" + comandesDLQ + "&classe=" + url.QueryEscape(class))
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("index down: %d, want 503", resp.StatusCode)
	}
	for _, internal := range []string{"closed pool", "postgres", "127.0.0.1", "5432", b.schema.Name} {
		if strings.Contains(body, internal) {
			t.Errorf("503 page shows %q", internal)
		}
	}
	_, body = br.get("/")
	if !strings.Contains(body, "unavailable") || strings.Contains(body, "closed pool") {
		t.Fatalf("overview with the index down:\n%s", body)
	}
}

// The console's server answers only the Host names of its address.
func TestHostCheck(t *testing.T) {
	t.Parallel()
	con, err := console.New(console.Config{Token: token})
	if err != nil {
		t.Fatal(err)
	}
	defer con.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := console.NewServer(ln, con.Handler(), nil)
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	for host, want := range map[string]int{ln.Addr().String(): 200, "evil.example": 421, "localhost:" + strings.Split(ln.Addr().String(), ":")[1]: 200} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+ln.Addr().String()+"/", nil)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("Host %s: %d, want %d", host, resp.StatusCode, want)
		}
	}
}
