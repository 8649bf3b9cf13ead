package dlq_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/transport"
)

func call(t *testing.T, method, u, token, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, u, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case strings.Contains(token, " "): // a whole Authorization value
		req.Header.Set("Authorization", token)
	case token != "":
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// Every endpoint needs the bearer token: a missing or wrong token is 401,
// shows nothing of a letter and changes nothing; the right one reads and
// replays.
func TestAdminAPIRequiresTokenForEveryEndpoint(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: DNI 12345678Z"})
	b.sync(t)
	// A budget this test's wrong tokens do not exhaust (the throttle has its
	// own tests).
	gate := dlq.NewGate("s3cret-token", dlq.GateConfig{PerSource: 1000, Global: 1000})
	srv := httptest.NewServer(dlq.Handler(b.svc, dlq.HandlerConfig{Gate: gate}))
	defer srv.Close()

	// Reads: every route that shows a letter's content, headers or motiu.
	reads := []string{"/letters", "/letters?motiu=" + url.QueryEscape("permanent: esquema: DNI"), "/letters/" + id,
		"/letters?motif=typo", "/letters/" + comandesDLQ + "/0/999"}
	for _, tok := range []string{"", "wrong", "Basic czNjcmV0LXRva2Vu", "Bearer", "Token s3cret-token"} {
		for _, p := range reads {
			code, body := call(t, "GET", srv.URL+p, tok, "")
			if code != 401 || strings.Contains(body, "12345678Z") || strings.Contains(body, id) {
				t.Fatalf("GET %s with %q: %d %s, want 401 and nothing of the letter", p, tok, code, body)
			}
		}
	}

	code, body := call(t, "GET", srv.URL+"/letters?motiu="+url.QueryEscape("permanent: esquema"), "s3cret-token", "")
	var ls struct {
		Groups  []dlq.Group      `json:"grups"`
		Letters []dlq.LetterView `json:"cartes"`
	}
	if code != 200 || json.Unmarshal([]byte(body), &ls) != nil || len(ls.Letters) != 1 || ls.Groups[0].Count != 1 {
		t.Fatalf("GET /letters: %d %s", code, body)
	}
	code, body = call(t, "GET", srv.URL+"/letters/"+id, "s3cret-token", "")
	var v dlq.LetterView
	if code != 200 || json.Unmarshal([]byte(body), &v) != nil || v.ID != id || v.Envelope == nil {
		t.Fatalf("GET /letters/%s: %d %s", id, code, body)
	}
	if code, _ := call(t, "GET", srv.URL+"/letters/"+comandesDLQ+"/0/999", "s3cret-token", ""); code != 404 {
		t.Fatalf("unknown letter: %d, want 404", code)
	}

	req := `{"ids":["` + id + `"]}`
	for _, tok := range []string{"", "wrong", "s3cret-token-but-longer", "s3cret-toke"} {
		// Authentication before validation: the same 401 whatever the body.
		for _, body := range []string{req, `{}`, `not json`, `{"ids":["x"],"nope":1}`} {
			if code, _ := call(t, "POST", srv.URL+"/replay", tok, body); code != 401 {
				t.Fatalf("replay with token %q and body %s: %d, want 401", tok, body, code)
			}
		}
		if code, _ := call(t, "POST", srv.URL+"/purge", tok, `{"yes":true}`); code != 401 {
			t.Fatalf("purge with token %q: %d, want 401", tok, code)
		}
	}
	if n := b.records(t, comandesRetry); n != 0 || b.rows(t, dlq.StatePending) != 1 {
		t.Fatalf("rejected calls changed something: %d records, %d pending", n, b.rows(t, dlq.StatePending))
	}
	code, body = call(t, "POST", srv.URL+"/replay", "s3cret-token", req)
	var rep dlq.Report
	if code != 200 || json.Unmarshal([]byte(body), &rep) != nil || rep.Done != 1 {
		t.Fatalf("authorised replay: %d %s", code, body)
	}
	if n := b.records(t, comandesRetry); n != 1 {
		t.Fatalf("%d records after the replay, want 1", n)
	}
	if code, _ := call(t, "POST", srv.URL+"/purge", "s3cret-token", `{"all":true}`); code != 409 {
		t.Fatalf("unconfirmed purge: %d, want 409", code)
	}
	// The scheme name is case-insensitive (RFC 9110 11.1); the token is not.
	if code, _ := call(t, "POST", srv.URL+"/purge", "bearer s3cret-token", `{"all":true}`); code != 409 {
		t.Fatalf("unconfirmed purge with scheme \"bearer\": %d, want 409", code)
	}
	if code, _ := call(t, "POST", srv.URL+"/purge", "Bearer S3CRET-TOKEN", `{"all":true}`); code != 401 {
		t.Fatalf("purge with the token in upper case: %d, want 401", code)
	}
	if code, _ := call(t, "POST", srv.URL+"/replay", "s3cret-token", `{"since":"yesterday-ish"}`); code != 400 {
		t.Fatalf("bad since: %d, want 400", code)
	}
	if code, _ := call(t, "POST", srv.URL+"/purge", "s3cret-token", `{"yes":true,"ids":["`+id+`"]}`); code != 200 || b.rows(t, dlq.StatePurged) != 1 {
		t.Fatalf("authorised purge: %d, %d purged", code, b.rows(t, dlq.StatePurged))
	}
}

// With no token configured every endpoint is disabled (403), even for a
// request that sends some token: nothing of a letter is shown, nothing
// changes, and the answer says how to set the token.
func TestAdminAPIWithoutTokenIsClosed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: DNI 12345678Z"})
	b.sync(t)
	srv := httptest.NewServer(dlq.Handler(b.svc, dlq.HandlerConfig{}))
	defer srv.Close()
	for _, tok := range []string{"", "anything"} {
		if code, _ := call(t, "POST", srv.URL+"/replay", tok, `{}`); code != 403 {
			t.Fatalf("replay: %d, want 403", code)
		}
		if code, _ := call(t, "POST", srv.URL+"/purge", tok, `{"yes":true}`); code != 403 {
			t.Fatalf("purge: %d, want 403", code)
		}
		for _, p := range []string{"/letters", "/letters?motiu=permanent", "/letters/" + id} {
			code, body := call(t, "GET", srv.URL+p, tok, "")
			if code != 403 || !strings.Contains(body, "KM0_DLQ_ADMIN_TOKEN") || strings.Contains(body, "12345678Z") || strings.Contains(body, id) {
				t.Fatalf("GET %s with no token configured: %d %s, want 403 naming KM0_DLQ_ADMIN_TOKEN", p, code, body)
			}
		}
	}
	if n := b.records(t, comandesRetry); n != 0 || b.rows(t, dlq.StatePending) != 1 {
		t.Fatalf("a disabled endpoint changed something: %d records, %d pending", n, b.rows(t, dlq.StatePending))
	}
}

// An age bound in days too large for a time.Duration must not wrap around
// into the future: "until=200000d" selects the letters dead more than 200,000
// days ago (none), never every letter.
func TestPurgeUntilHugeAgeSelectsNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for range 2 {
		b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
	}
	b.sync(t)
	srv := httptest.NewServer(dlq.Handler(b.svc, dlq.HandlerConfig{Token: "tok"}))
	defer srv.Close()
	code, body := call(t, "POST", srv.URL+"/purge", "tok", `{"yes":true,"until":"200000d"}`)
	if p, q := b.rows(t, dlq.StatePurged), b.rows(t, dlq.StatePending); p != 0 || q != 2 {
		t.Fatalf("purge until 200000d: %d %s; %d purged and %d pending, want 0 and 2", code, body, p, q)
	}
}

// A body that is not exactly one JSON object is bad input (400) and changes
// nothing: a decoder that stopped after the first object would purge every
// letter for `{"yes":true}{"ids":[...]}`.
func TestAdminAPIRefusesTrailingDataInBody(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
	b.produceDead(t, dead{topic: comandes, key: "P-2", reason: "permanent: esquema: x"})
	b.sync(t)
	srv := httptest.NewServer(dlq.Handler(b.svc, dlq.HandlerConfig{Token: "tok"}))
	defer srv.Close()
	for _, body := range []string{`{"yes":true}{"ids":["` + id + `"]}`, `{"yes":true} x`} {
		code, resp := call(t, "POST", srv.URL+"/purge", "tok", body)
		if p := b.rows(t, dlq.StatePurged); code != 400 || p != 0 {
			t.Fatalf("purge with body %s: %d %s, %d purged; want 400 and 0", body, code, resp, p)
		}
	}
}

// An unknown query parameter of GET /letters is a 400, not a filter silently
// dropped (a typo would list every letter as if it matched).
func TestAdminAPIRefusesUnknownFilter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
	b.sync(t)
	srv := httptest.NewServer(dlq.Handler(b.svc, dlq.HandlerConfig{Token: "tok"}))
	defer srv.Close()
	if code, body := call(t, "GET", srv.URL+"/letters?motif=permanent", "tok", ""); code != 400 {
		t.Fatalf("GET /letters?motif=: %d %s, want 400", code, body)
	}
	if code, body := call(t, "GET", srv.URL+"/letters?motiu=permanent&estat=totes&limit=5", "tok", ""); code != 200 {
		t.Fatalf("GET /letters with known filters: %d %s, want 200", code, body)
	}
}

// GET /letters rows are bounded: a limit of 0 ("all") or
// above MaxListLimit is a 400, never a whole DLQ loaded into memory.
func TestAdminAPIBoundsTheRowsOfAListing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	now := time.Now()
	letters := make([]*dlq.Letter, dlq.MaxListLimit+1)
	for i := range letters {
		letters[i] = dlq.NewLetter(comandesDLQ, 0, int64(i), now, &transport.Message{Value: []byte("{}"),
			Headers: []transport.Header{{Key: contract.HeaderReason, Value: "permanent: esquema: x"}}})
	}
	if added, err := b.store.Insert(b.ctx, letters); err != nil || len(added) != len(letters) {
		t.Fatalf("insert: %d, %v", len(added), err)
	}
	srv := httptest.NewServer(dlq.Handler(b.svc, dlq.HandlerConfig{Token: "tok"}))
	defer srv.Close()
	rows := func(query string) (int, int) {
		code, body := call(t, "GET", srv.URL+"/letters?"+query, "tok", "")
		var ls struct {
			Letters []dlq.LetterView `json:"cartes"`
		}
		_ = json.Unmarshal([]byte(body), &ls)
		return code, len(ls.Letters)
	}
	for _, q := range []string{"limit=0", "limit=" + strconv.Itoa(dlq.MaxListLimit+1)} {
		if code, n := rows(q); code != 400 || n != 0 {
			t.Fatalf("GET /letters?%s: %d with %d rows, want 400", q, code, n)
		}
	}
	if code, n := rows("limit=" + strconv.Itoa(dlq.MaxListLimit)); code != 200 || n != dlq.MaxListLimit {
		t.Fatalf("GET /letters?limit=%d: %d with %d rows", dlq.MaxListLimit, code, n)
	}
}
