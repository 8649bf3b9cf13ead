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
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/km0/km0/dlq"
)

// cookieName is the session cookie.
const cookieName = "km0_consola"

// auth holds the admin token's Gate (shared with the DLQ admin API on the
// same listener: one attempt budget) and the open sessions (in memory: a
// restart logs everyone out).
type auth struct {
	gate    *dlq.Gate
	enabled bool
	ttl     time.Duration
	now     func() time.Time

	mu       sync.Mutex
	sessions map[string]*session // by the SHA-256 of the cookie value
}

// session is one login.
type session struct {
	csrf    string
	expires time.Time
	actor   string // who, in the audit log: "console:<first 12 hex of the cookie's digest>"
}

func (a *auth) init(g *dlq.Gate, ttl time.Duration, now func() time.Time) {
	a.gate, a.enabled = g, g.Enabled()
	a.ttl, a.now = ttl, now
	a.sessions = map[string]*session{}
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
	s := &session{csrf: randomToken(), expires: a.now().Add(a.ttl), actor: "console:" + digest(id)[:12]}
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
	ck, err := r.Cookie(cookieName)
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
	if ck, err := r.Cookie(cookieName); err == nil {
		a.mu.Lock()
		delete(a.sessions, digest(ck.Value))
		a.mu.Unlock()
	}
}

// noToken is the answer to a login or a letter's page when no token is
// configured.
const noToken = "no admin token is configured: this console shows counts only (set KM0_DLQ_ADMIN_TOKEN)"

func setCookie(w http.ResponseWriter, r *http.Request, value string, maxAge int) {
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: value, Path: "/", MaxAge: maxAge,
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
				code, msg = http.StatusForbidden, noToken
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

// login opens a session for the right token. The body is read first and
// the attempt is counted by the Gate before the token is compared, so slow
// bodies sent together are evaluated at most as often as the budget allows.
func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	if !c.auth.enabled {
		c.errorPage(w, r, http.StatusForbidden, noToken)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	next := safeNext(r.PostFormValue("next"))
	switch v, wait := c.auth.gate.Check(r, r.PostFormValue("token")); v {
	case dlq.Granted:
		id, _ := c.auth.open()
		setCookie(w, r, id, int(c.cfg.SessionTTL.Seconds()))
		http.Redirect(w, r, next, http.StatusSeeOther)
	case dlq.Throttled:
		w.Header().Set("Retry-After", strconv.Itoa(int(wait.Seconds())+1))
		c.render(w, r, http.StatusTooManyRequests, "login", map[string]any{"Error": "too many wrong tokens from this address: wait a minute", "Next": next})
	default:
		c.cfg.Logger.Warn("console: wrong admin token", "remote", r.RemoteAddr)
		c.render(w, r, http.StatusUnauthorized, "login", map[string]any{"Error": "wrong token", "Next": next})
	}
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	c.auth.close(r)
	setCookie(w, r, "", -1)
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// safeNext keeps a redirect target on this console: a path, never a URL or
// a scheme-relative //host. A target with a control character (browsers drop
// TAB, CR and LF from URLs, so "/\t/host" would become "//host") or a
// backslash (read as a slash) anywhere, or in its path also percent-encoded,
// is refused.
func safeNext(p string) string {
	if len(p) == 0 || p[0] != '/' || (len(p) > 1 && p[1] == '/') || unsafeInURL(p) {
		return "/"
	}
	path, _, _ := strings.Cut(p, "?")
	if u, err := url.PathUnescape(path); err != nil || unsafeInURL(u) || strings.HasPrefix(u, "//") {
		return "/"
	}
	return p
}

// unsafeInURL reports whether s holds a control character or a backslash.
func unsafeInURL(s string) bool {
	for i := 0; i < len(s); i++ {
		if b := s[i]; b < 0x20 || b == 0x7f || b == '\\' {
			return true
		}
	}
	return false
}
