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
	v := &lagView{Snap: snap, Chart: makeChart(hist, c.cfg.Now()), AllGroups: c.allGroups(r)}
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
	c.renderPage(w, r, http.StatusOK, "lag", page{Title: "Lag and health", Data: map[string]any{
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
		State string `json:"estat"`
	}
	_ = json.NewDecoder(http.MaxBytesReader(nil, resp.Body, 4096)).Decode(&body)
	row.OK = resp.StatusCode/100 == 2
	switch {
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

// chart is an inline SVG line chart of the last hour: one line per group,
// outbox and queue.
type chart struct {
	Width, Height int
	Max           int64
	Series        []series
	From, To      time.Time
	Ticks         []tick
}

type series struct {
	Name   string
	Class  string // CSS class (colour)
	Points string // SVG polyline points
	Last   int64
}

type tick struct {
	X     float64
	Label string
}

const (
	chartW, chartH = 720, 200
	chartLeft      = 40
	maxSeries      = 10
)

// makeChart draws points over [now-1h, now]; nil without points.
func makeChart(points []lag.Point, now time.Time) *chart {
	if len(points) == 0 {
		return nil
	}
	from := now.Add(-lag.WindowDefault)
	ch := &chart{Width: chartW, Height: chartH, From: from, To: now}
	type key struct{ kind, name string }
	vals := map[key][]struct {
		at time.Time
		v  int64
	}{}
	for _, p := range points {
		for _, km := range []struct {
			kind string
			m    map[string]int64
		}{{"grup", p.Groups}, {"grup", p.Others}, {"outbox", p.Outboxes}, {"cua", p.Queues}} {
			kind := km.kind
			for name, v := range km.m {
				k := key{kind, name}
				vals[k] = append(vals[k], struct {
					at time.Time
					v  int64
				}{p.At, v})
				ch.Max = max(ch.Max, v)
			}
		}
	}
	if ch.Max == 0 {
		ch.Max = 1
	}
	keys := slices.SortedFunc(maps.Keys(vals), func(a, b key) int {
		return strings.Compare(a.kind+" "+a.name, b.kind+" "+b.name)
	})
	// The series with the largest last values, when there are too many.
	slices.SortStableFunc(keys, func(a, b key) int {
		la, lb := vals[a][len(vals[a])-1].v, vals[b][len(vals[b])-1].v
		return int(lb - la)
	})
	if len(keys) > maxSeries {
		keys = keys[:maxSeries]
	}
	x := func(t time.Time) float64 {
		return chartLeft + float64(chartW-chartLeft)*float64(t.Sub(from))/float64(now.Sub(from))
	}
	y := func(v int64) float64 { return float64(chartH) - float64(chartH-10)*float64(v)/float64(ch.Max) }
	for i, k := range keys {
		var b strings.Builder
		for _, p := range vals[k] {
			if p.at.Before(from) {
				continue
			}
			fmt.Fprintf(&b, "%.1f,%.1f ", x(p.at), y(p.v))
		}
		vs := vals[k]
		ch.Series = append(ch.Series, series{Name: k.kind + " " + k.name, Class: fmt.Sprintf("s%d", i), Points: b.String(), Last: vs[len(vs)-1].v})
	}
	for m := 0; m <= 60; m += 15 {
		t := from.Add(time.Duration(m) * time.Minute)
		ch.Ticks = append(ch.Ticks, tick{X: x(t), Label: fmt.Sprintf("-%dm", 60-m)})
	}
	return ch
}
