package dlq_test

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/km0/km0/dlq"
)

// clock is a settable clock for the Gate's buckets.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

func from(addr string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/login", nil)
	r.RemoteAddr = addr
	return r
}

// Attempts are counted before the token is compared: 300 guesses made at
// once from one address are evaluated at most GatePerSourceDefault times.
func TestGateCountsEveryAttemptBeforeEvaluating(t *testing.T) {
	t.Parallel()
	g := dlq.NewGate("right", dlq.GateConfig{})
	var mu sync.Mutex
	n := map[dlq.Verdict]int{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 300 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			v, _ := g.Check(from("198.51.100.7:4000"), "guess")
			mu.Lock()
			n[v]++
			mu.Unlock()
		}()
	}
	close(start)
	wg.Wait()
	if n[dlq.Denied] != dlq.GatePerSourceDefault || n[dlq.Throttled] != 300-dlq.GatePerSourceDefault || n[dlq.Granted] != 0 {
		t.Fatalf("300 concurrent guesses: %d denied (evaluated), %d throttled, %d granted; want %d, %d, 0",
			n[dlq.Denied], n[dlq.Throttled], n[dlq.Granted], dlq.GatePerSourceDefault, 300-dlq.GatePerSourceDefault)
	}
	// The right token from the flooding address is throttled too: the
	// attacker cannot tell it.
	if v, wait := g.Check(from("198.51.100.7:4001"), "right"); v != dlq.Throttled || wait <= 0 || wait > dlq.GateWindow {
		t.Fatalf("right token from the flooding address: %v after %s, want Throttled", v, wait)
	}
}

// A flood from one address never throttles the operator at another, known
// or not; a distributed flood exhausts the global ceiling for unknown
// addresses only; the budgets refill.
func TestGateFloodFromOneSourceSparesTheOperator(t *testing.T) {
	t.Parallel()
	c := &clock{t: time.Date(2026, 12, 1, 22, 0, 0, 0, time.UTC)}
	g := dlq.NewGate("right", dlq.GateConfig{Now: c.now})
	for range 1000 {
		g.Check(from("203.0.113.9:5000"), "guess")
	}
	if v, _ := g.Check(from("203.0.113.9:5000"), "guess"); v != dlq.Throttled {
		t.Fatalf("the flooding address after 1,000 guesses: %v, want Throttled", v)
	}
	if v, _ := g.Check(from("192.0.2.10:6000"), "right"); v != dlq.Granted {
		t.Fatalf("the operator at another address during the flood: %v, want Granted", v)
	}
	// The right token gives its attempt back: the operator can go on.
	for i := range 3 * dlq.GatePerSourceDefault {
		if v, _ := g.Check(from("192.0.2.10:6000"), "right"); v != dlq.Granted {
			t.Fatalf("operator's call %d: %v, want Granted", i, v)
		}
	}
	// A distributed flood: one guess from each of many addresses.
	denied := 0
	for i := range 500 {
		ip := "10.1." + strconv.Itoa(i/250) + "." + strconv.Itoa(i%250)
		if v, _ := g.Check(from(ip+":1"), "guess"); v == dlq.Denied {
			denied++
		}
	}
	if max := dlq.GateGlobalDefault - dlq.GatePerSourceDefault; denied > max {
		t.Fatalf("a distributed flood got %d guesses evaluated, want at most %d", denied, max)
	}
	if v, _ := g.Check(from("198.18.0.1:1"), "right"); v != dlq.Throttled {
		t.Fatalf("an unknown address during a distributed flood: %v, want Throttled", v)
	}
	if v, _ := g.Check(from("192.0.2.10:6001"), "right"); v != dlq.Granted {
		t.Fatalf("the known operator during a distributed flood: %v, want Granted", v)
	}
	c.add(dlq.GateWindow)
	if v, _ := g.Check(from("198.18.0.1:1"), "right"); v != dlq.Granted {
		t.Fatalf("an unknown address a window later: %v, want Granted", v)
	}
	// IPv6: one /64 is one source.
	for i := range dlq.GatePerSourceDefault {
		g.Check(from("[2001:db8:1:2::"+strconv.Itoa(i+1)+"]:1"), "guess")
	}
	if v, _ := g.Check(from("[2001:db8:1:2:ffff::1]:1"), "right"); v != dlq.Throttled {
		t.Fatalf("another address of the flooding /64: %v, want Throttled", v)
	}
	if v, _ := g.Check(from("[2001:db8:1:3::1]:1"), "right"); v != dlq.Granted {
		t.Fatalf("another /64: %v, want Granted", v)
	}
}

// X-Forwarded-For is not trusted: it does not make a flood look like many
// sources.
func TestGateIgnoresForwardedFor(t *testing.T) {
	t.Parallel()
	g := dlq.NewGate("right", dlq.GateConfig{})
	for i := range dlq.GatePerSourceDefault {
		r := from("198.51.100.8:1")
		r.Header.Set("X-Forwarded-For", "10.9.9."+strconv.Itoa(i))
		g.Check(r, "guess")
	}
	r := from("198.51.100.8:1")
	r.Header.Set("X-Forwarded-For", "10.9.9.200")
	if v, _ := g.Check(r, "guess"); v != dlq.Throttled {
		t.Fatalf("guess with a new X-Forwarded-For: %v, want Throttled", v)
	}
}

// The admin API's token checks go through the Gate: after the budget of
// wrong tokens from one address it answers 429 with Retry-After there, even
// to the right token, whatever the body, while the right token from another
// address is evaluated (and then the body validated: 400).
func TestAdminAPIThrottlesTokenGuesses(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
	b.sync(t)
	h := dlq.Handler(b.svc, dlq.HandlerConfig{Token: "s3cret-token"})
	post := func(addr, tok, body string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, "/replay", strings.NewReader(body))
		r.RemoteAddr = addr
		r.Header.Set("Authorization", "Bearer "+tok)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	for i := range dlq.GatePerSourceDefault {
		body := `{"all":true}`
		if i%2 == 1 {
			body = `not json`
		}
		if w := post("203.0.113.5:1000", "guess", body); w.Code != 401 {
			t.Fatalf("wrong token %d with body %s: %d, want 401", i, body, w.Code)
		}
	}
	for _, tok := range []string{"guess", "s3cret-token"} {
		w := post("203.0.113.5:1001", tok, `not json`)
		if w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") == "" {
			t.Fatalf("token %q after the budget: %d (Retry-After %q), want 429", tok, w.Code, w.Header().Get("Retry-After"))
		}
	}
	if w := post("192.0.2.20:2000", "s3cret-token", `not json`); w.Code != 400 {
		t.Fatalf("the operator from another address: %d %s, want 400 (authenticated, then the body refused)", w.Code, w.Body)
	}
	if n := b.records(t, comandes); n != 0 || b.rows(t, dlq.StatePending) != 1 {
		t.Fatalf("refused calls changed something: %d records, %d pending", n, b.rows(t, dlq.StatePending))
	}
}
