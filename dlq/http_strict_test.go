package dlq_test

import (
	"encoding/json"
	"net/http/httptest"
	"testing"

	"github.com/km0/km0/dlq"
)

// A POST body that two JSON readers could read differently, or that selects
// nothing, is a 400 and changes nothing: `null` and `{}` used to replay every
// pending letter, and `{"dry_run":true,"DRY_RUN":false}` ran a real replay
// (case-insensitive names, last duplicate wins). Every letter is selected
// only by an explicit "all": true.
func TestAdminAPIStrictBodiesAndExplicitAll(t *testing.T) {
	b := setup(t)
	b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
	b.produceDead(t, dead{topic: comandes, key: "P-2", reason: "permanent: esquema: x"})
	b.sync(t)
	srv := httptest.NewServer(dlq.Handler(b.svc, dlq.HandlerConfig{Token: "tok"}))
	defer srv.Close()
	for _, body := range []string{
		`null`, ` null `, `{}`, `{"dry_run": true, "DRY_RUN": false}`, `{"dry_run":true,"dry_run":false}`,
		`{"Dry_Run":true}`, `{"dry_run":null,"all":true}`, `{"ids":null}`, `{"ids":[]}`, `{"all":false}`,
		`{"all":true,"all":false}`, `{"ALL":true}`, `{"all":true,"topic":"` + comandes + `"}`, `[]`,
	} {
		for _, ep := range []string{"/replay", "/purge"} {
			req := body
			if ep == "/purge" && body[0] == '{' && body != `{}` {
				req = `{"yes":true,` + body[1:]
			}
			code, resp := call(t, "POST", srv.URL+ep, "tok", req)
			if code != 400 {
				t.Errorf("POST %s %s: %d %s, want 400", ep, req, code, resp)
			}
		}
	}
	if n, q := b.records(t, comandes), b.rows(t, dlq.StatePending); n != 0 || q != 2 {
		t.Fatalf("refused bodies changed something: %d records replayed, %d pending; want 0 and 2", n, q)
	}
	code, body := call(t, "POST", srv.URL+"/replay", "tok", `{"all":true,"dry_run":true}`)
	var rep dlq.Report
	if code != 200 || json.Unmarshal([]byte(body), &rep) != nil || !rep.DryRun || rep.Selected != 2 || b.records(t, comandes) != 0 {
		t.Fatalf("dry run of all: %d %s", code, body)
	}
	if code, body := call(t, "POST", srv.URL+"/purge", "tok", `{"all":true,"yes":true}`); code != 200 || b.rows(t, dlq.StatePurged) != 2 {
		t.Fatalf("purge of all: %d %s, %d purged", code, body, b.rows(t, dlq.StatePurged))
	}
}
