package dlq_test

import (
	"encoding/json"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/testlog"
)

// A POST body that two JSON readers could read differently, or that selects
// nothing, is a 400 and changes nothing: `null` and `{}` used to replay every
// pending letter, and `{"dry_run":true,"DRY_RUN":false}` ran a real replay
// (case-insensitive names, last duplicate wins). Every letter is selected
// only by an explicit "all": true.
func TestAdminAPIStrictBodiesAndExplicitAll(t *testing.T) {
	t.Parallel()
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

// A GET the index cannot answer never shows PostgreSQL's text to the caller
// (with the token): a NUL byte or invalid UTF-8 in a filter is a 400
// with a clear message, and a database that is down is a 503 that names no
// user, database, host or port; the full error goes to the server log.
func TestAdminAPIErrorsShowNoInternals(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
	b.sync(t)
	srv := httptest.NewServer(dlq.Handler(b.svc, dlq.HandlerConfig{Token: "tok"}))
	defer srv.Close()
	internals := []string{"SQLSTATE", "invalid byte sequence", "UTF8", "postgres", b.schema.Name}
	for _, path := range []string{"/letters?topic=%00", "/letters?motiu=a%00b", "/letters?topic=%ff",
		"/letters?id=a%00", "/letters/x%00y"} {
		code, body := call(t, "GET", srv.URL+path, "tok", "")
		if code != 400 || !strings.Contains(body, "NUL byte or invalid UTF-8") {
			t.Errorf("GET %s: %d %s, want 400 naming the bad byte", path, code, body)
		}
		for _, s := range internals {
			if strings.Contains(body, s) {
				t.Errorf("GET %s shows %q: %s", path, s, body)
			}
		}
	}
	if code, body := call(t, "POST", srv.URL+"/replay", "tok", `{"topic":"a\u0000b"}`); code != 400 {
		t.Errorf("POST /replay with a NUL in topic: %d %s, want 400", code, body)
	}

	// The database is down: a pool on a port nobody listens on.
	pool, err := pgxpool.New(b.ctx, "postgres://geheimuser@127.0.0.1:1/geheimdb?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: dlq.NewStore(pool, b.schema.Name), Backend: b.backend})
	if err != nil {
		t.Fatal(err)
	}
	logs := &testlog.Buffer{}
	down := httptest.NewServer(dlq.Handler(svc, dlq.HandlerConfig{Token: "tok",
		Logger: slog.New(slog.NewTextHandler(logs, nil))}))
	defer down.Close()
	for _, c := range []struct{ method, path, body string }{{"GET", "/letters", ""}, {"GET", "/letters/a.dlq/0/1", ""},
		{"POST", "/replay", `{"all":true}`}} {
		code, body := call(t, c.method, down.URL+c.path, "tok", c.body)
		if code != 503 {
			t.Errorf("%s %s with the database down: %d %s, want 503", c.method, c.path, code, body)
		}
		for _, s := range []string{"geheimuser", "geheimdb", "127.0.0.1", ":1", "dial", "connect"} {
			if strings.Contains(body, s) {
				t.Errorf("%s %s with the database down shows %q: %s", c.method, c.path, s, body)
			}
		}
	}
	if !strings.Contains(logs.String(), "127.0.0.1") {
		t.Errorf("the server log lacks the full error:\n%s", logs.String())
	}
}
