package console

import (
	"bytes"
	"fmt"
	"html/template"
	"net/http"
	"strconv"
	"time"
)

var funcs = template.FuncMap{
	"stamp": func(t time.Time) string {
		if t.IsZero() {
			return "unknown"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"age": func(secs float64) string {
		if secs <= 0 {
			return "-"
		}
		return (time.Duration(secs * float64(time.Second))).Round(time.Second).String()
	},
	// bytes is n bytes for people: 592 B, 12.5 KiB, 3.0 MiB.
	"bytes": func(n int64) string {
		if n < 1024 {
			return strconv.FormatInt(n, 10) + " B"
		}
		f, unit := float64(n)/1024, "KiB"
		for _, u := range []string{"MiB", "GiB", "TiB"} {
			if f < 1024 {
				break
			}
			f, unit = f/1024, u
		}
		return strconv.FormatFloat(f, 'f', 1, 64) + " " + unit
	},
	"clip": func(n int, s string) string {
		if r := []rune(s); len(r) > n {
			return string(r[:n-1]) + "…"
		}
		return s
	},
	"pct": func(done, total int) int {
		if total == 0 {
			return 100
		}
		return done * 100 / total
	},
}

// page is what every template gets: the page's own data and the layout's.
type page struct {
	Title    string
	LoggedIn bool
	CanLogin bool // a token is configured
	CSRF     string
	Broker   string
	Data     any
	Refresh  int // seconds; 0 = none
	Rendered time.Time
}

// render executes the template name into a buffer first, so that a template
// error answers 500 instead of half a page.
func (c *Console) render(w http.ResponseWriter, r *http.Request, code int, name string, data any) {
	c.renderPage(w, r, code, name, page{Data: data})
}

func (c *Console) renderPage(w http.ResponseWriter, r *http.Request, code int, name string, p page) {
	t := c.pages[name]
	if t == nil {
		http.Error(w, "no such page", http.StatusInternalServerError)
		return
	}
	s := sessionOf(r)
	if s == nil {
		s = c.auth.lookup(r)
	}
	p.LoggedIn, p.CanLogin, p.Broker, p.Rendered = s != nil, c.auth.enabled, c.cfg.Broker, c.cfg.Now()
	if s != nil {
		p.CSRF = s.csrf
	}
	var buf bytes.Buffer
	if err := t.ExecuteTemplate(&buf, "layout", p); err != nil {
		c.cfg.Logger.Error("console: template", "page", name, "err", err)
		http.Error(w, "the page could not be built; the server log has the details", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	_, _ = buf.WriteTo(w)
}

func (c *Console) errorPage(w http.ResponseWriter, r *http.Request, code int, msg string) {
	c.renderPage(w, r, code, "error", page{Title: fmt.Sprintf("%d %s", code, http.StatusText(code)), Data: msg})
}

// refreshSeconds is how often the pages that show counts, lag and health
// refresh themselves (by script; without it, a meta refresh).
const refreshSeconds = 5
