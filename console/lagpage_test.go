package console_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/console"
	"github.com/km0/km0/lag"
)

// The lag page and /lag.json show the system's consumer groups; a foreign
// group the sampler measured (another Kafka client's "intrus") appears only
// with ?groups=all, or by default with Config.AllGroups.
func TestLagPageShowsForeignGroupsOnRequest(t *testing.T) {
	t.Parallel()
	sampler := lag.NewSampler(lag.SamplerConfig{})
	sampler.Add(&lag.Snapshot{At: time.Now(), Groups: []lag.GroupLag{
		{Group: "intrus", Total: 9, Foreign: true},
		{Group: "inventari.descompte_estoc", Total: 2},
	}})
	for _, c := range []struct {
		allGroups bool
		query     string
		want      bool // intrus shown
	}{{false, "", false}, {false, "?groups=all", true}, {false, "?groups=other", false}, {true, "", true}} {
		con, err := console.New(console.Config{Sampler: sampler, AllGroups: c.allGroups, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(con.Handler())
		get := func(path string) string {
			resp, err := http.Get(srv.URL + path)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("GET %s: %s\n%s", path, resp.Status, b)
			}
			return string(b)
		}
		page := get("/lag" + c.query)
		if strings.Contains(page, "intrus") != c.want || !strings.Contains(page, "inventari.descompte_estoc") {
			t.Errorf("AllGroups %v, GET /lag%s: intrus shown %v, want %v\n%s", c.allGroups, c.query, !c.want, c.want, page)
		}
		var v struct {
			Latest  lag.Snapshot `json:"ultima"`
			History []lag.Point  `json:"historia"`
		}
		if err := json.Unmarshal([]byte(get("/lag.json"+c.query)), &v); err != nil || len(v.History) != 1 {
			t.Fatalf("GET /lag.json%s: %v %+v", c.query, err, v)
		}
		n := map[bool]int{false: 1, true: 2}[c.want]
		if len(v.Latest.Groups) != n || (v.History[0].Others["intrus"] == 9) != c.want || v.History[0].Groups["inventari.descompte_estoc"] != 2 {
			t.Errorf("AllGroups %v, GET /lag.json%s: groups %+v, history %+v", c.allGroups, c.query, v.Latest.Groups, v.History)
		}
		srv.Close()
		con.Close()
	}
}

// The chart draws every series that had lag in the window, outboxes
// included, largest peak first: 12 groups with lag now, a burst of 50 that
// is over, an outbox with pending rows; a group never behind is left out and
// counted. The window is the operator's choice: a burst 10 minutes ago is in
// the hour and not in the last 5 minutes.
func TestLagChartShowsTheSeriesThatMatter(t *testing.T) {
	t.Parallel()
	sampler := lag.NewSampler(lag.SamplerConfig{})
	now := time.Now()
	snap := func(at time.Time, burst int64) *lag.Snapshot {
		s := &lag.Snapshot{At: at, Outboxes: []lag.OutboxLag{{Name: "comandes", Pending: 3}}}
		for i := range 12 {
			s.Groups = append(s.Groups, lag.GroupLag{Group: fmt.Sprintf("g%02d", i), Total: int64(i + 1)})
		}
		s.Groups = append(s.Groups, lag.GroupLag{Group: "burst", Total: burst}, lag.GroupLag{Group: "quiet", Total: 0})
		return s
	}
	sampler.Add(snap(now.Add(-10*time.Minute), 50))
	sampler.Add(snap(now.Add(-10*time.Minute+3*time.Second), 0))
	sampler.Add(snap(now.Add(-time.Second), 0))
	con, err := console.New(console.Config{Sampler: sampler, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(con.Close)
	srv := httptest.NewServer(con.Handler())
	t.Cleanup(srv.Close)
	get := func(path string) string {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	drawn := func(page string) []string {
		var out []string
		for _, m := range regexp.MustCompile(`<li class="series" data-name="([^"]+)">`).FindAllStringSubmatch(page, -1) {
			out = append(out, m[1])
		}
		return out
	}
	page := get("/lag")
	got := drawn(page)
	if len(got) != 14 || got[0] != "grup burst" || !slices.Contains(got, "outbox comandes") || slices.Contains(got, "grup quiet") ||
		!strings.Contains(page, `<p class="muted" id="idle-series">1 more with no lag in the window.</p>`) {
		t.Fatalf("the hour's series: %d %v\n%s", len(got), got, page)
	}
	got = drawn(get("/lag?finestra=5m"))
	if len(got) != 13 || slices.Contains(got, "grup burst") || got[0] != "grup g11" || !slices.Contains(got, "outbox comandes") {
		t.Fatalf("the last 5 minutes' series: %d %v", len(got), got)
	}
}

// The lag page shows a WAL-mode outbox by its slot: the unconfirmed bytes,
// the retained WAL and the status; "?" for the age of a slot a relay
// streams from; a table outbox keeps its rows.
func TestLagPageShowsWALOutboxes(t *testing.T) {
	t.Parallel()
	sampler := lag.NewSampler(lag.SamplerConfig{})
	sampler.Add(&lag.Snapshot{At: time.Now(), Outboxes: []lag.OutboxLag{
		{Name: "comandes", Pending: 3, OldestSeconds: 90},
		{Name: "pagaments", OldestSeconds: 3600, WAL: &lag.SlotLag{Slot: "km0_wal_pagaments_public_outbox", LagBytes: 592,
			RetainedBytes: 3 << 20, WALStatus: "reserved", OldestKnown: true}},
		{Name: "inventari", WAL: &lag.SlotLag{Slot: "km0_wal_inventari_public_outbox", LagBytes: 12800, RetainedBytes: 13000,
			WALStatus: "reserved", Active: true}},
	}})
	con, err := console.New(console.Config{Sampler: sampler, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer con.Close()
	srv := httptest.NewServer(con.Handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/lag")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	page := string(b)
	for _, want := range []string{
		"<td>comandes</td><td class=\"num\">3 rows</td>\n<td>1m30s</td>\n<td>-</td>",
		"<td>pagaments</td><td class=\"num\">592 B unconfirmed</td>\n<td>1h0m0s</td>\n<td>km0_wal_pagaments_public_outbox: 3.0 MiB retained, reserved, <span class=\"bad\">no relay</span></td>",
		"<td>inventari</td><td class=\"num\">12.5 KiB unconfirmed</td>\n<td><span class=\"muted\" title=\"a relay streams from the slot: see its km0_relay_cdc_slot_lag_seconds\">?</span></td>\n<td>km0_wal_inventari_public_outbox: 12.7 KiB retained, reserved, streaming</td>",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("GET /lag: no %q in\n%s", want, page)
		}
	}
}
