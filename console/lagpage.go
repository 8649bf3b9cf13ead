package console

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/km0/km0/lag"
)

// lagView is what the pages show of the lag.
type lagView struct {
	Snap   *lag.Snapshot
	Chart  *chart
	Firing []string
	// AllGroups: the foreign groups are shown (Config.AllGroups or
	// ?groups=all); Toggle is the link to the other selection, "" when
	// Config.AllGroups leaves none.
	AllGroups bool
	Toggle    string
}

// groupsAll is the query parameter value of /lag and /lag.json that shows
// the foreign consumer groups too: ?groups=all.
const groupsAll = "all"

// allGroups tells whether r sees the foreign consumer groups.
func (c *Console) allGroups(r *http.Request) bool {
	return c.cfg.AllGroups || r.URL.Query().Get("groups") == groupsAll
}

// latestLag returns the Sampler's latest snapshot and history, without the
// foreign groups unless r asks for them.
func (c *Console) latestLag(r *http.Request) (*lag.Snapshot, []lag.Point) {
	snap, hist := c.cfg.Sampler.Latest(), c.cfg.Sampler.History()
	if !c.allGroups(r) {
		snap, hist = snap.WithoutForeign(), lag.WithoutForeign(hist)
	}
	return snap, hist
}

func (c *Console) lagView(r *http.Request) *lagView {
	if c.cfg.Sampler == nil {
		return nil
	}
	snap, hist := c.latestLag(r)
	name, window := chartWindow(r)
	v := &lagView{Snap: snap, Chart: makeChart(hist, c.cfg.Now(), window), AllGroups: c.allGroups(r)}
	if v.Chart != nil {
		v.Chart.Window = name
		for _, w := range chartWindows {
			q := r.URL.Query()
			q.Set("finestra", w.Name)
			v.Chart.Windows = append(v.Chart.Windows, windowLink{Name: w.Name, Query: "?" + q.Encode(), Current: w.Name == name})
		}
	}
	switch {
	case c.cfg.AllGroups:
	case v.AllGroups:
		v.Toggle = "/lag"
	default:
		v.Toggle = "/lag?groups=" + groupsAll
	}
	return v
}

func (c *Console) lagPage(w http.ResponseWriter, r *http.Request) {
	c.renderPage(w, r, http.StatusOK, "lag", page{Title: "Lag and health", Refresh: refreshSeconds, Data: map[string]any{
		"Lag": c.lagView(r), "Health": c.health(r.Context()),
	}})
}

func (c *Console) lagJSON(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	var v any = map[string]any{}
	if c.cfg.Sampler != nil {
		snap, hist := c.latestLag(r)
		v = map[string]any{"ultima": snap, "historia": hist}
	}
	_ = json.NewEncoder(w).Encode(v)
}

// healthRow is one service's health.
type healthRow struct {
	Name  string
	OK    bool
	State string
}

// health probes every service at once, each within HealthTimeout.
func (c *Console) health(ctx context.Context) []healthRow {
	out := make([]healthRow, len(c.cfg.Services))
	var wg sync.WaitGroup
	for i, s := range c.cfg.Services {
		wg.Go(func() {
			out[i] = c.probe(ctx, s)
		})
	}
	wg.Wait()
	return out
}

func (c *Console) probe(ctx context.Context, s Service) healthRow {
	row := healthRow{Name: s.Name, State: "does not answer"}
	path := s.Path
	if path == "" {
		path = "/salut"
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.HealthTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(s.URL, "/")+path, nil)
	if err != nil {
		row.State = "bad URL"
		return row
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.cfg.Logger.Debug("console: health probe", "service", s.Name, "err", err)
		return row
	}
	defer resp.Body.Close()
	var body struct {
		State  string   `json:"estat"`
		Paused []string `json:"pausats"`
	}
	_ = json.NewDecoder(http.MaxBytesReader(nil, resp.Body, 4096)).Decode(&body)
	row.OK = resp.StatusCode/100 == 2
	switch {
	case row.OK && len(body.Paused) > 0:
		row.State = "ok, paused: " + clipString(strings.Join(body.Paused, ", "), 120)
	case row.OK:
		row.State = "ok"
	case body.State != "":
		row.State = fmt.Sprintf("%d: %s", resp.StatusCode, clipString(body.State, 80))
	default:
		row.State = resp.Status
	}
	return row
}

func clipString(s string, n int) string {
	if r := []rune(s); len(r) > n {
		return string(r[:n])
	}
	return s
}

// chart is an inline SVG line chart of a window of the last hour: one line
// per group, outbox and queue that had lag at some point of the window.
type chart struct {
	Width, Height int
	Max           int64
	Series        []series
	From, To      time.Time
	Ticks         []tick
	Window        string // its name, e.g. "15m"
	Windows       []windowLink
	Idle          int // series left out: no lag in the whole window
}

type series struct {
	Name   string
	Class  string // CSS class (colour)
	Points string // SVG polyline points
	Last   int64
	Peak   int64 // the largest value in the window
}

type tick struct {
	X     float64
	Label string
}

// windowLink is a choice of the chart's window.
type windowLink struct {
	Name    string
	Query   string
	Current bool
}

const (
	chartW, chartH = 720, 200
	chartLeft      = 40
	// maxSeries caps the lines drawn; the series that had lag in the window
	// go first, largest peak first. Colours repeat after ten.
	maxSeries = 24
)

// chartWindows are the windows the operator can choose (?finestra=), the
// default last; the sampler keeps lag.WindowDefault.
var chartWindows = []struct {
	Name string
	D    time.Duration
}{{"5m", 5 * time.Minute}, {"15m", 15 * time.Minute}, {"1h", time.Hour}}

// chartWindow is the window r asks for (?finestra=5m, 15m or 1h; default 1h).
func chartWindow(r *http.Request) (string, time.Duration) {
	w := r.URL.Query().Get("finestra")
	for _, c := range chartWindows {
		if c.Name == w {
			return c.Name, c.D
		}
	}
	last := chartWindows[len(chartWindows)-1]
	return last.Name, last.D
}

// makeChart draws points over [now-window, now]: every series with lag at
// some point of the window (outboxes, groups and queues alike), largest peak
// first; the series without any are counted in Idle, and drawn only when no
// series had lag (flat at zero). nil without points.
func makeChart(points []lag.Point, now time.Time, window time.Duration) *chart {
	if len(points) == 0 {
		return nil
	}
	from := now.Add(-window)
	ch := &chart{Width: chartW, Height: chartH, From: from, To: now}
	type key struct{ kind, name string }
	type pt struct {
		at time.Time
		v  int64
	}
	vals := map[key][]pt{}
	peak := map[key]int64{}
	for _, p := range points {
		if p.At.Before(from) {
			continue
		}
		for _, km := range []struct {
			kind string
			m    map[string]int64
		}{{"grup", p.Groups}, {"grup", p.Others}, {"outbox", p.Outboxes}, {"cua", p.Queues}} {
			for name, v := range km.m {
				k := key{km.kind, name}
				vals[k] = append(vals[k], pt{p.At, v})
				peak[k] = max(peak[k], v)
			}
		}
	}
	keys := slices.SortedFunc(maps.Keys(vals), func(a, b key) int {
		if peak[a] != peak[b] {
			if peak[a] > peak[b] {
				return -1
			}
			return 1
		}
		return strings.Compare(a.kind+" "+a.name, b.kind+" "+b.name)
	})
	busy := 0
	for _, k := range keys {
		if peak[k] > 0 {
			busy++
		}
	}
	if busy > 0 {
		ch.Idle = len(keys) - busy
		keys = keys[:busy]
	}
	if len(keys) > maxSeries {
		keys = keys[:maxSeries]
	}
	for _, k := range keys {
		ch.Max = max(ch.Max, peak[k])
	}
	if ch.Max == 0 {
		ch.Max = 1
	}
	x := func(t time.Time) float64 {
		return chartLeft + float64(chartW-chartLeft)*float64(t.Sub(from))/float64(now.Sub(from))
	}
	y := func(v int64) float64 { return float64(chartH) - float64(chartH-10)*float64(v)/float64(ch.Max) }
	for i, k := range keys {
		var b strings.Builder
		for _, p := range vals[k] {
			fmt.Fprintf(&b, "%.1f,%.1f ", x(p.at), y(p.v))
		}
		vs := vals[k]
		ch.Series = append(ch.Series, series{Name: k.kind + " " + k.name, Class: fmt.Sprintf("s%d", i%10), Points: b.String(),
			Last: vs[len(vs)-1].v, Peak: peak[k]})
	}
	for q := 0; q <= 4; q++ {
		t := from.Add(window * time.Duration(q) / 4)
		ch.Ticks = append(ch.Ticks, tick{X: x(t), Label: "-" + shortDuration(window*time.Duration(4-q)/4)})
	}
	return ch
}

// shortDuration is d as the chart's ticks show it: 45s, 3m45s, 1h.
func shortDuration(d time.Duration) string {
	s := d.Round(time.Second).String()
	s = strings.TrimSuffix(s, "0s")
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	if s == "" {
		return "0"
	}
	return s
}
