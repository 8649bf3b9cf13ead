package dlq

import (
	"cmp"
	"crypto/sha256"
	"crypto/subtle"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Defaults of GateConfig.
const (
	// GatePerSourceDefault is how many token attempts one source may make
	// per GateWindow (a bucket that refills at that rate).
	GatePerSourceDefault = 10
	// GateGlobalDefault is how many attempts all sources that are not
	// known-good may make together per GateWindow.
	GateGlobalDefault = 100
	// GateKnownForDefault is how long a source that presented the right
	// token stays known-good (exempt from the global ceiling).
	GateKnownForDefault = 24 * time.Hour
)

// gateWindow is the period over which the attempt budgets refill.
const gateWindow = time.Minute

// gateMaxSources bounds the per-source table: beyond it, idle sources (a
// full bucket) are forgotten.
const gateMaxSources = 4096

// GateConfig configures a Gate. Every field is optional.
type GateConfig struct {
	// PerSource: attempts per GateWindow of one source. Default
	// GatePerSourceDefault.
	PerSource int
	// Global: attempts per GateWindow of every source that is not known-good,
	// together. Default GateGlobalDefault.
	Global int
	// KnownFor: how long a source stays known-good after the right token.
	// Default GateKnownForDefault.
	KnownFor time.Duration
	// Source names the source of a request. Default: the peer's IP
	// address (X-Forwarded-For is never trusted).
	Source func(*http.Request) string
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// Verdict is the outcome of Gate.Check.
type Verdict int

// Verdicts of Gate.Check.
const (
	// Granted: the right token.
	Granted Verdict = iota
	// Denied: a missing or wrong token (the attempt was counted).
	Denied
	// Throttled: the source, or every unknown source together, made too many
	// attempts lately; the token was not evaluated.
	Throttled
	// Disabled: no token is configured; nothing can be granted.
	Disabled
)

// String names v: granted, denied, throttled or disabled.
func (v Verdict) String() string {
	switch v {
	case Granted:
		return "granted"
	case Denied:
		return "denied"
	case Throttled:
		return "throttled"
	case Disabled:
		return "disabled"
	}
	return "Verdict(" + strconv.Itoa(int(v)) + ")"
}

// Gate is the one check of the admin token, used by the DLQ admin API and
// the console's login on every listener: a constant-time comparison behind
// an attempt limiter.
//
// Every attempt is counted before the token is evaluated, so concurrent
// requests cannot all be evaluated: at most the budget is. Each source has a
// bucket of PerSource attempts refilling over GateWindow; sources that are
// not known-good also draw on a global bucket of Global attempts, the
// ceiling against a distributed guesser. A source that presents the right
// token gets its attempt back and is known-good for KnownFor, so a flood from
// one address never throttles the operator at another, and a distributed
// flood never throttles a known operator. A Gate is safe for concurrent use;
// share one between every handler that checks the same token.
type Gate struct {
	want    [32]byte
	enabled bool
	cfg     GateConfig

	mu      sync.Mutex
	global  bucket
	sources map[string]*bucket
	known   map[string]time.Time // source -> known-good until
}

// NewGate returns a Gate for token; an empty token disables it (every Check
// is Disabled).
func NewGate(token string, cfg GateConfig) *Gate {
	cfg.PerSource = cmp.Or(cfg.PerSource, GatePerSourceDefault)
	cfg.Global = cmp.Or(cfg.Global, GateGlobalDefault)
	cfg.KnownFor = cmp.Or(cfg.KnownFor, GateKnownForDefault)
	if cfg.Source == nil {
		cfg.Source = sourceOf
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	g := &Gate{want: sha256.Sum256([]byte(token)), enabled: token != "", cfg: cfg,
		sources: map[string]*bucket{}, known: map[string]time.Time{}}
	g.global = bucket{size: float64(cfg.Global), tokens: float64(cfg.Global), at: cfg.Now()}
	return g
}

// Enabled reports whether a token is configured.
func (g *Gate) Enabled() bool { return g.enabled }

// Check counts one attempt of r's source and then, if the budgets allow it,
// compares got with the token in constant time (digests of equal length:
// neither the token's length nor its content leaks). When Throttled, wait is
// how long until the source may try again.
func (g *Gate) Check(r *http.Request, got string) (v Verdict, wait time.Duration) {
	if !g.enabled {
		return Disabled, 0
	}
	src := g.cfg.Source(r)
	b, known, wait, ok := g.reserve(src)
	if !ok {
		return Throttled, wait
	}
	sum := sha256.Sum256([]byte(got))
	if subtle.ConstantTimeCompare(sum[:], g.want[:]) != 1 {
		return Denied, 0
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.cfg.Now()
	b.give(now)
	if !known {
		g.global.give(now)
	}
	g.known[src] = now.Add(g.cfg.KnownFor)
	return Granted, 0
}

// reserve takes one attempt from src's bucket and, for a source not
// known-good, from the global one; a source's entry is created only once the
// global bucket let it in, so unknown sources cannot grow the table faster
// than the global budget.
func (g *Gate) reserve(src string) (b *bucket, known bool, wait time.Duration, ok bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.cfg.Now()
	if until, k := g.known[src]; k && now.Before(until) {
		known = true
	} else if k {
		delete(g.known, src)
	}
	b = g.sources[src]
	if b != nil && !b.take(now) {
		return nil, known, b.wait(now), false
	}
	if !known && !g.global.take(now) {
		if b != nil {
			b.give(now) // not evaluated: the source's attempt is not spent
		}
		return nil, known, g.global.wait(now), false
	}
	if b == nil {
		if len(g.sources) >= gateMaxSources {
			g.forgetIdle(now)
		}
		b = &bucket{size: float64(g.cfg.PerSource), tokens: float64(g.cfg.PerSource), at: now}
		b.take(now)
		g.sources[src] = b
	}
	return b, known, 0, true
}

// forgetIdle drops the sources whose bucket is full again (they made no
// attempt for a whole window) and the expired known-good sources.
func (g *Gate) forgetIdle(now time.Time) {
	for k, b := range g.sources {
		if b.refill(now); b.tokens >= b.size {
			delete(g.sources, k)
		}
	}
	for k, until := range g.known {
		if !now.Before(until) {
			delete(g.known, k)
		}
	}
}

// sourceOf is the default source of a request: the IP address of its peer
// (r.RemoteAddr), an IPv6 address by its /64 network (one host usually holds
// a whole /64). Headers such as X-Forwarded-For are ignored: anyone can send
// them.
func sourceOf(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return host
	}
	if ip.To4() == nil {
		return ip.Mask(net.CIDRMask(64, 128)).String() + "/64"
	}
	return ip.String()
}

// bucket is a token bucket of size attempts refilling size per GateWindow.
type bucket struct {
	size, tokens float64
	at           time.Time
}

func (b *bucket) refill(now time.Time) {
	if d := now.Sub(b.at); d > 0 {
		b.tokens = min(b.size, b.tokens+b.size*d.Seconds()/gateWindow.Seconds())
	}
	b.at = now
}

func (b *bucket) take(now time.Time) bool {
	b.refill(now)
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

func (b *bucket) give(now time.Time) {
	b.refill(now)
	b.tokens = min(b.size, b.tokens+1)
}

// wait is how long until the bucket holds one attempt.
func (b *bucket) wait(now time.Time) time.Duration {
	b.refill(now)
	if b.tokens >= 1 {
		return 0
	}
	return time.Duration((1 - b.tokens) * float64(gateWindow) / b.size)
}
