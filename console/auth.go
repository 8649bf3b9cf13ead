package console

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// CookieName is the session cookie.
const CookieName = "km0_consola"

// Login throttling: at most maxFailures wrong tokens per failureWindow, for
// everyone together; then logins are refused until the window ends.
const (
	maxFailures   = 10
	failureWindow = time.Minute
)

// auth holds the admin token's digest and the open sessions (in memory: a
// restart logs everyone out).
type auth struct {
	want    [32]byte
	enabled bool
	ttl     time.Duration
	now     func() time.Time

	mu       sync.Mutex
	sessions map[string]*session // by the SHA-256 of the cookie value
	failures []time.Time
}

// session is one login.
type session struct {
	csrf    string
	expires time.Time
}

func (a *auth) init(token string, ttl time.Duration, now func() time.Time) {
	a.enabled = token != ""
	a.want = sha256.Sum256([]byte(token))
	a.ttl, a.now = ttl, now
	a.sessions = map[string]*session{}
}

// check compares got with the token in constant time (digests of equal
// length, so neither the token's length nor its content leaks).
func (a *auth) check(got string) bool {
	sum := sha256.Sum256([]byte(got))
	return a.enabled && subtle.ConstantTimeCompare(sum[:], a.want[:]) == 1
}

// throttled reports whether too many wrong tokens came lately, and records
// one more failure when failed.
func (a *auth) throttled(failed bool) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	kept := a.failures[:0]
	for _, t := range a.failures {
		if now.Sub(t) < failureWindow {
			kept = append(kept, t)
		}
	}
	a.failures = kept
	if failed {
		a.failures = append(a.failures, now)
	}
	return len(a.failures) >= maxFailures
}

func randomToken() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	return base64.RawURLEncoding.EncodeToString(b)
}

func digest(v string) string {
	sum := sha256.Sum256([]byte(v))
	return hex.EncodeToString(sum[:])
}

// open starts a session and returns its cookie value.
func (a *auth) open() (string, *session) {
	id := randomToken()
	s := &session{csrf: randomToken(), expires: a.now().Add(a.ttl)}
	a.mu.Lock()
	defer a.mu.Unlock()
	for k, old := range a.sessions { // forget expired sessions
		if a.now().After(old.expires) {
			delete(a.sessions, k)
		}
	}
	a.sessions[digest(id)] = s
	return id, s
}

// lookup returns the session of r's cookie, or nil.
func (a *auth) lookup(r *http.Request) *session {
	ck, err := r.Cookie(CookieName)
	if err != nil || ck.Value == "" {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.sessions[digest(ck.Value)]
	if s == nil || a.now().After(s.expires) {
		return nil
	}
	return s
}

func (a *auth) close(r *http.Request) {
	if ck, err := r.Cookie(CookieName); err == nil {
		a.mu.Lock()
		delete(a.sessions, digest(ck.Value))
		a.mu.Unlock()
	}
}

func setCookie(w http.ResponseWriter, r *http.Request, value string, maxAge int) {
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: value, Path: "/", MaxAge: maxAge,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
}

type ctxKey struct{}

// sessionOf returns the session withSession found, or nil.
func sessionOf(r *http.Request) *session {
	s, _ := r.Context().Value(ctxKey{}).(*session)
	return s
}

// withSession runs next only for a logged-in operator, and for a POST only
// with the session's CSRF token in the form field "csrf". Without a session
// a GET is sent to the login form and a POST gets 401.
func (c *Console) withSession(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s := c.auth.lookup(r)
		if s == nil {
			if r.Method == http.MethodGet && c.auth.enabled {
				http.Redirect(w, r, "/login?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
				return
			}
			code, msg := http.StatusUnauthorized, "log in with the admin token first"
			if !c.auth.enabled {
				code, msg = http.StatusForbidden, "no admin token is configured: this console shows counts only (set KM0_DLQ_ADMIN_TOKEN)"
			}
			c.errorPage(w, r, code, msg)
			return
		}
		if r.Method == http.MethodPost {
			r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
			got := r.PostFormValue("csrf")
			if subtle.ConstantTimeCompare([]byte(got), []byte(s.csrf)) != 1 {
				c.errorPage(w, r, http.StatusForbidden, "missing or stale form token: reload the page and try again")
				return
			}
		}
		next(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, s)))
	}
}

func (c *Console) loginPage(w http.ResponseWriter, r *http.Request) {
	c.render(w, r, http.StatusOK, "login", map[string]any{"Next": safeNext(r.URL.Query().Get("next"))})
}

func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	if !c.auth.enabled {
		c.errorPage(w, r, http.StatusForbidden, "no admin token is configured: this console shows counts only (set KM0_DLQ_ADMIN_TOKEN)")
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if c.auth.throttled(false) {
		c.render(w, r, http.StatusTooManyRequests, "login", map[string]any{"Error": "too many wrong tokens: wait a minute"})
		return
	}
	next := safeNext(r.PostFormValue("next"))
	if !c.auth.check(r.PostFormValue("token")) {
		c.auth.throttled(true)
		c.cfg.Logger.Warn("console: wrong admin token", "remote", r.RemoteAddr)
		c.render(w, r, http.StatusUnauthorized, "login", map[string]any{"Error": "wrong token", "Next": next})
		return
	}
	id, _ := c.auth.open()
	setCookie(w, r, id, int(c.cfg.SessionTTL.Seconds()))
	http.Redirect(w, r, next, http.StatusSeeOther)
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	c.auth.close(r)
	setCookie(w, r, "", -1)
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// safeNext keeps a redirect target on this console: a path, never a URL or
// a scheme-relative //host.
func safeNext(p string) string {
	if len(p) == 0 || p[0] != '/' || (len(p) > 1 && (p[1] == '/' || p[1] == '\\')) {
		return "/"
	}
	return p
}
