package console_test

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
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
