// Package console is km0's operator console: a small web application,
// embedded in the binary and working offline, that shows the dead letters
// by failure group (topic or queue × reason class) and lets an operator
// read them, replay them (dry run, confirmation, progress, result) and purge
// them; the lag of every outbox, consumer group and queue with a chart of
// the last hour; and the health of every service.
//
// Access: counts (groups, lag, health) are open; reading a letter and every
// change need the admin token of the DLQ admin API, given once in a login
// form, which opens a session (an HttpOnly, SameSite=Strict cookie) whose
// CSRF token every form carries. The login's token goes through a dlq.Gate
// (share the one of the DLQ admin API on the same listener, Config.Gate):
// every attempt is counted before the token is compared, per source address
// with a global ceiling. With no token configured the console shows counts
// only. Errors never show internals; the log has them.
package console

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/km0/km0/internal/hostguard"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Defaults of Config.
const (
	SessionTTLDefault    = 8 * time.Hour
	HealthTimeoutDefault = 2 * time.Second
	// replayWatchDefault is Config.ReplayWatch's default.
	replayWatchDefault = 5 * time.Second
)

// Service is one service whose health the console shows: GET URL + Path
// answering 2xx means healthy.
type Service struct {
	Name string
	URL  string // base URL, e.g. http://127.0.0.1:8080
	Path string // default "/salut" (system.HealthPath)
}

// Config configures a Console. Every part is optional.
type Config struct {
	// Source is the dead-letter index and its broker (Kafka or RabbitMQ);
	// nil: no dead-letter section.
	Source dlq.Source
	// Broker names the Source's broker in the page ("Kafka", "RabbitMQ", or
	// another name for both, e.g. "Kafka + RabbitMQ" over a
	// dlq.MixedBackend); RabbitMQ offers no record deletion on purge.
	Broker string
	// Token is the admin token (the DLQ admin API's, $KM0_DLQ_ADMIN_TOKEN).
	// Empty: counts only; nobody can log in.
	Token string
	// Gate checks the token of a login and throttles attempts; pass the one
	// of the DLQ admin API on the same listener (dlq.HandlerConfig.Gate) so
	// that both draw on one budget. Default dlq.NewGate(Token, ...); when
	// set, Token is ignored.
	Gate *dlq.Gate
	// KeyOrder, if set, is the database holding the keyorder tables of the
	// per-key order consumers (schema KeyOrderSchema, default public): the
	// page of a letter that is a key's blocked head shows the key's sequence
	// (the head and the messages parked behind it) and offers to replay it
	// as one.
	KeyOrder       keyorder.DBTX
	KeyOrderSchema string
	// ServiceDBs are the services' own databases: every service's blocked
	// keys (page /claus, and the sequence on a head's letter page) and the
	// pause of its consumer groups (page /consumidors). Each service keeps
	// its key-order tables in its own database; KeyOrder is one more,
	// without a name.
	ServiceDBs []ServiceDB
	// Sampler provides lag and its history; nil: no lag section.
	Sampler *lag.Sampler
	// AllGroups shows the foreign consumer groups the Sampler measured
	// (lag.GroupLag.Foreign) without asking. Default false: only the
	// system's groups, others on request (?groups=all on /lag, /lag.json).
	AllGroups bool
	// Services are probed for health on each page view.
	Services []Service
	// Retention is the consumers' idempotency retention replays respect.
	// Default inbox.RetentionDefault.
	Retention time.Duration
	// SessionTTL is how long a login lasts. Default SessionTTLDefault.
	SessionTTL time.Duration
	// HealthTimeout bounds each health probe. Default HealthTimeoutDefault.
	HealthTimeout time.Duration
	// ReplayWatch is how long the console watches a replay whose result it
	// shows at once (an edited letter, a blocked key's sequence, every
	// blocked sequence of a consumer) for the consumer dead-lettering the
	// event again (dlq.Source.Watch); it answers as soon as every replayed
	// letter died again. Default 5 s.
	ReplayWatch time.Duration
	Logger      *slog.Logger
	Now         func() time.Time
}

// Console is the console's HTTP handler and its background replay jobs.
type Console struct {
	cfg    Config
	pages  map[string]*template.Template
	static http.Handler
	ctx    context.Context // ends on Close: stops running jobs
	cancel context.CancelFunc
	hc     *http.Client

	auth auth

	jobsMu sync.Mutex
	jobs   map[string]*job
	plans  map[string]*plan // dry runs a confirmation may act on (plans.go), under jobsMu
	wg     sync.WaitGroup
}

// New returns a Console. It fails only if its embedded templates do not
// parse (a build defect).
func New(cfg Config) (*Console, error) {
	cfg.Retention = cmp.Or(cfg.Retention, inbox.RetentionDefault)
	cfg.SessionTTL = cmp.Or(cfg.SessionTTL, SessionTTLDefault)
	cfg.HealthTimeout = cmp.Or(cfg.HealthTimeout, HealthTimeoutDefault)
	cfg.ReplayWatch = cmp.Or(cfg.ReplayWatch, replayWatchDefault)
	cfg.Broker = cmp.Or(cfg.Broker, "Kafka")
	cfg.KeyOrderSchema = cmp.Or(cfg.KeyOrderSchema, migrate.SchemaDefault)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	c := &Console{cfg: cfg, pages: map[string]*template.Template{}, jobs: map[string]*job{}, plans: map[string]*plan{},
		hc: &http.Client{Timeout: cfg.HealthTimeout}}
	if cfg.Gate == nil {
		cfg.Gate = dlq.NewGate(cfg.Token, dlq.GateConfig{Now: cfg.Now})
	}
	c.auth.init(cfg.Gate, cfg.SessionTTL, cfg.Now)
	c.ctx, c.cancel = context.WithCancel(context.Background())
	pages, err := fs.Glob(templateFS, "templates/*.html")
	if err != nil {
		return nil, err
	}
	for _, p := range pages {
		name := strings.TrimSuffix(strings.TrimPrefix(p, "templates/"), ".html")
		if name == "layout" {
			continue
		}
		t, err := template.New(name).Funcs(funcs).ParseFS(templateFS, "templates/layout.html", p)
		if err != nil {
			return nil, err
		}
		c.pages[name] = t
	}
	sub, err := fs.Sub(staticFS, "static")
	if err != nil {
		return nil, err
	}
	c.static = http.StripPrefix("/static/", http.FileServerFS(sub))
	c.resumeJobs()
	return c, nil
}

// Close stops running replay jobs (a job stops before its next letter; what
// it republished stays marked, and a console started again resumes it) and
// waits for them.
func (c *Console) Close() {
	c.cancel()
	c.wg.Wait()
}

// Handler returns the console's routes.
func (c *Console) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /static/", c.static)
	mux.HandleFunc("GET /{$}", c.overview)
	mux.HandleFunc("GET /login", c.loginPage)
	mux.HandleFunc("POST /login", c.login)
	mux.HandleFunc("POST /logout", c.withSession(c.logout))
	mux.HandleFunc("GET /lag", c.lagPage)
	mux.HandleFunc("GET /lag.json", c.lagJSON)
	mux.HandleFunc("GET /grup", c.withSession(c.groupPage))
	mux.HandleFunc("GET /carta", c.withSession(c.letterPage))
	mux.HandleFunc("POST /reproduir/previsualitzar", c.withSession(c.replayPreview))
	mux.HandleFunc("POST /reproduir", c.withSession(c.replayStart))
	mux.HandleFunc("GET /feina", c.withSession(c.jobPage))
	mux.HandleFunc("GET /feina.json", c.withSession(c.jobJSON))
	mux.HandleFunc("POST /feina/cancellar", c.withSession(c.jobCancel))
	mux.HandleFunc("POST /feina/reprendre", c.withSession(c.jobResume))
	mux.HandleFunc("POST /purgar/confirmar", c.withSession(c.purgeConfirm))
	mux.HandleFunc("POST /purgar", c.withSession(c.purge))
	mux.HandleFunc("POST /sequencia/reproduir", c.withSession(c.replaySequence))
	mux.HandleFunc("POST /sequencia/saltar", c.withSession(c.skipSequence))
	mux.HandleFunc("POST /sequencies/reproduir", c.withSession(c.replaySequences))
	mux.HandleFunc("GET /carta/editar", c.withSession(c.editPage))
	mux.HandleFunc("POST /carta/editar", c.withSession(c.editReplay))
	mux.HandleFunc("GET /auditoria", c.withSession(c.auditPage))
	mux.HandleFunc("GET /claus", c.withSession(c.blockedPage))
	mux.HandleFunc("GET /consumidors", c.withSession(c.consumersPage))
	mux.HandleFunc("POST /consumidors/pausar", c.withSession(c.pauseGroup(true)))
	mux.HandleFunc("POST /consumidors/reprendre", c.withSession(c.pauseGroup(false)))
	return c.headers(mux)
}

// NewServer returns an HTTP server for h (the console's Handler, maybe
// beside more routes) on ln: its Host check (hostguard.Wrap: the listen
// address, loopback names, and allowed, as the services' servers) and
// timeouts.
func NewServer(ln net.Listener, h http.Handler, allowed []string) *http.Server {
	return &http.Server{Handler: hostguard.Wrap(h, ln.Addr(), allowed), ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout: 30 * time.Second, WriteTimeout: time.Minute, IdleTimeout: 2 * time.Minute}
}

// headers sets the security headers of every answer: nothing but the
// console's own scripts and styles, no framing, no caching (pages hold
// customer data), no referrer to other sites.
func (c *Console) headers(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hd := w.Header()
		hd.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "+
			"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		hd.Set("X-Frame-Options", "DENY")
		hd.Set("X-Content-Type-Options", "nosniff")
		hd.Set("Referrer-Policy", "same-origin") // no-referrer would make browsers send Origin: null
		hd.Set("Cache-Control", "no-store")
		if r.Method == http.MethodPost && !sameOrigin(r) {
			c.errorPage(w, r, http.StatusForbidden, "cross-origin request refused")
			return
		}
		h.ServeHTTP(w, r)
	})
}

// sameOrigin reports whether a POST comes from the console's own pages.
// A browser says where a request comes from in Sec-Fetch-Site (it must be
// same-origin) or, older ones, in Origin (it must name this host). A client
// that sends neither is not a browser that another site could drive.
func sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" {
		return site == "same-origin"
	}
	o := r.Header.Get("Origin")
	if o == "" {
		return true
	}
	_, host, ok := strings.Cut(o, "://")
	return ok && strings.EqualFold(host, r.Host)
}

// errBadInput marks a form value the console refuses (400).
var errBadInput = errors.New("bad input")

// text returns form value v, refusing NUL bytes and invalid UTF-8 (the
// index cannot hold them, so they could match nothing).
func text(v string) (string, error) {
	if strings.ContainsRune(v, 0) || !utf8.ValidString(v) || len(v) > 4096 {
		return "", errBadInput
	}
	return v, nil
}

// fail answers err without internals; the log has it.
func (c *Console) fail(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, dlq.ErrNotFound):
		c.errorPage(w, r, http.StatusNotFound, "no such letter")
	case errors.Is(err, errBadInput):
		c.errorPage(w, r, http.StatusBadRequest, "bad input: a value with a NUL byte, invalid UTF-8 or over 4 KiB")
	default:
		c.cfg.Logger.Error("console", "method", r.Method, "path", r.URL.Path, "err", err)
		c.errorPage(w, r, http.StatusServiceUnavailable, "the dead-letter index or the broker is unavailable; the server log has the details")
	}
}
