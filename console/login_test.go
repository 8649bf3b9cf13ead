package console_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
)

// bare is a console without a dead-letter source (a login needs none).
func bare(t *testing.T) *console.Console {
	t.Helper()
	con, err := console.New(console.Config{Token: token, Logger: quietLog})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(con.Close)
	return con
}

// loginFrom posts a login form to h as if from addr.
func loginFrom(h http.Handler, addr string, form url.Values) *httptest.ResponseRecorder {
	r := httptest.NewRequest(http.MethodPost, "/login", strings.NewReader(form.Encode()))
	r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	r.RemoteAddr = addr
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// The throttle counts an attempt when the token is evaluated, after the
// body is read: 300 connections that all got into the handler (the server
// answered their "Expect: 100-continue", so each is reading its body) and
// then sent their bodies get at most GatePerSourceDefault tokens evaluated;
// the rest get 429.
func TestLoginSlowBodiesAreEvaluatedWithinTheBudget(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(bare(t).Handler())
	defer srv.Close()
	const n = 300
	body := url.Values{"token": {"guess"}, "next": {"/"}}.Encode()
	conns := make([]net.Conn, n)
	readers := make([]*bufio.Reader, n)
	for i := range conns {
		c, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(60 * time.Second))
		fmt.Fprintf(c, "POST /login HTTP/1.1\r\nHost: %s\r\nContent-Type: application/x-www-form-urlencoded\r\n"+
			"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n", srv.Listener.Addr(), len(body))
		conns[i], readers[i] = c, bufio.NewReader(c)
	}
	// Every handler is running and waiting for its body.
	for i, rd := range readers {
		resp, err := http.ReadResponse(rd, nil)
		if err != nil || resp.StatusCode != http.StatusContinue {
			t.Fatalf("connection %d: %v %v, want 100 Continue", i, err, resp)
		}
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = c.Write([]byte(body))
			resp, err := http.ReadResponse(readers[i], nil)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				codes[0]++
				return
			}
			resp.Body.Close()
			codes[resp.StatusCode]++
		}()
	}
	wg.Wait()
	if codes[http.StatusUnauthorized] > dlq.GatePerSourceDefault || codes[http.StatusTooManyRequests] < n-dlq.GatePerSourceDefault ||
		codes[http.StatusSeeOther] != 0 || codes[0] != 0 {
		t.Fatalf("%d slow bodies: answers %v; want at most %d evaluated (401) and the rest 429", n, codes, dlq.GatePerSourceDefault)
	}
}

// A flood of wrong tokens from one address gets 429 there (with
// Retry-After, even for the right token), and never locks out the operator
// at another address.
func TestLoginFloodFromOneSourceDoesNotLockOutTheOperator(t *testing.T) {
	t.Parallel()
	h := bare(t).Handler()
	codes := map[int]int{}
	for range 50 {
		codes[loginFrom(h, "203.0.113.66:4444", url.Values{"token": {"guess"}}).Code]++
	}
	if codes[http.StatusUnauthorized] != dlq.GatePerSourceDefault || codes[http.StatusTooManyRequests] != 50-dlq.GatePerSourceDefault {
		t.Fatalf("50 wrong tokens from one address: %v, want %d × 401 and the rest 429", codes, dlq.GatePerSourceDefault)
	}
	w := loginFrom(h, "192.0.2.44:5555", url.Values{"token": {token}, "next": {"/"}})
	if w.Code != http.StatusSeeOther || !strings.Contains(w.Header().Get("Set-Cookie"), console.CookieName+"=") {
		t.Fatalf("the operator from another address: %d, cookie %q; want 303 with a session", w.Code, w.Header().Get("Set-Cookie"))
	}
	if w := loginFrom(h, "203.0.113.66:4445", url.Values{"token": {token}}); w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") == "" {
		t.Fatalf("the right token from the flooding address: %d (Retry-After %q), want 429", w.Code, w.Header().Get("Retry-After"))
	}
}

// The login's next never leaves the console: a control character (browsers
// drop TAB, CR, LF, so "/\t/host" is "//host") or a backslash anywhere, also
// percent-encoded in the path, sends to /; a path of the console is kept.
func TestLoginNextStaysOnTheConsole(t *testing.T) {
	t.Parallel()
	h := bare(t).Handler()
	for _, next := range []string{"/\t/evil.example/phish", "/\n/evil.example", "/\r/evil.example", "\t//evil.example",
		"/\\evil.example", "/a\\b", "/x\x00y", "/x\x7fy", "/%09/evil.example/phish", "/%5Cevil.example", "/%2F/evil.example",
		"//evil.example", "https://evil.example/", "evil.example", "/?x=\t", "/?x=\\"} {
		w := loginFrom(h, "192.0.2.1:1", url.Values{"token": {token}, "next": {next}})
		if w.Code != http.StatusSeeOther || w.Header().Get("Location") != "/" {
			t.Errorf("next %q: %d to %q, want 303 to /", next, w.Code, w.Header().Get("Location"))
		}
	}
	for _, next := range []string{"/carta?id=" + url.QueryEscape(comandesDLQ+"/0/1"), "/?motiu=" + url.QueryEscape("adreça"), "/lag"} {
		w := loginFrom(h, "192.0.2.1:1", url.Values{"token": {token}, "next": {next}})
		if w.Code != http.StatusSeeOther || w.Header().Get("Location") != next {
			t.Errorf("next %q: %d to %q, want 303 to it", next, w.Code, w.Header().Get("Location"))
		}
	}
	// The form of GET /login carries only a safe next.
	r := httptest.NewRequest(http.MethodGet, "/login?next=/%09/evil.example/phish", nil)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	if !strings.Contains(rec.Body.String(), `name="next" value="/"`) {
		t.Errorf("GET /login?next=/%%09/evil.example: the form's next is not /:\n%s", rec.Body)
	}
}
