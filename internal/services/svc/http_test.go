package svc_test

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/km0/km0/internal/hostguard"
	"github.com/km0/km0/internal/services/svc"
)

func TestRequireJSON(t *testing.T) {
	t.Parallel()
	for ct, want := range map[string]bool{"application/json": true, "application/json; charset=utf-8": true, "APPLICATION/JSON;charset=UTF-8": true,
		"": false, "text/plain": false, "application/json; charset=utf-16": false, "application/json; boundary=x": false, "application/json;;": false,
		"multipart/form-data; boundary=x": false, "application/x-www-form-urlencoded": false} {
		r := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("{}"))
		if ct != "" {
			r.Header.Set("Content-Type", ct)
		}
		w := httptest.NewRecorder()
		if got := svc.RequireJSON(w, r); got != want || (!got && w.Code != http.StatusUnsupportedMediaType) {
			t.Errorf("Content-Type %q: got %v (%d), want %v", ct, got, w.Code, want)
		}
	}
}

// TestErrorAnswersCarryAListedCode: WriteError writes the English message,
// the codi and the camp in that order (camp left out when empty);
// WriteFieldError takes a FieldError's code, camp_invalid by default; every
// code is snake_case, used once, and in the table of docs/contract.md; and
// the Host check's 421 (internal/hostguard, below svc) says host_desconegut.
func TestErrorAnswersCarryAListedCode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		write  func(http.ResponseWriter)
		status int
		want   string
	}{
		{func(w http.ResponseWriter) {
			svc.WriteError(w, 404, svc.CodeUnknownOrder, "id", "no order P-2026-000001")
		}, 404,
			`{"error":"no order P-2026-000001","codi":"comanda_desconeguda","camp":"id"}`},
		{func(w http.ResponseWriter) {
			svc.WriteError(w, 503, svc.CodeUnavailable, "", "could not read the order")
		}, 503,
			`{"error":"could not read the order","codi":"no_disponible"}`},
		{func(w http.ResponseWriter) { svc.WriteFieldError(w, svc.Fieldf("linies", "the order has no line")) }, 400,
			`{"error":"linies: the order has no line","codi":"camp_invalid","camp":"linies"}`},
		{func(w http.ResponseWriter) {
			svc.WriteFieldError(w, &svc.FieldError{Field: "mercat", Reason: "unknown", Code: svc.CodeUnknownMarket})
		}, 400, `{"error":"mercat: unknown","codi":"mercat_desconegut","camp":"mercat"}`},
		{func(w http.ResponseWriter) { svc.WriteFieldError(w, svc.DecodeJSON([]byte(`[1]`), &struct{}{})) }, 400,
			`{"error":"cos: wrong type: expected an object, got array","codi":"camp_invalid","camp":"cos"}`},
	} {
		w := httptest.NewRecorder()
		tc.write(w)
		if got := strings.TrimSpace(w.Body.String()); w.Code != tc.status || got != tc.want {
			t.Errorf("%d %s, want %d %s", w.Code, got, tc.status, tc.want)
		}
	}

	doc, err := os.ReadFile("../../../docs/contract.md")
	if err != nil {
		t.Fatal(err)
	}
	snake := regexp.MustCompile(`^[a-z]+(_[a-z]+)*$`)
	seen := map[string]bool{}
	for _, c := range svc.Codes() {
		if !snake.MatchString(c.String()) || seen[c.String()] {
			t.Errorf("code %q: want snake_case, once", c)
		}
		seen[c.String()] = true
		if !regexp.MustCompile("(?m)^\\| `" + c.String() + "` \\| [0-9]{3} \\|").Match(doc) {
			t.Errorf("code %s is not in the table of error codes in docs/contract.md (| `%s` | status | meaning |)", c, c)
		}
	}
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-z_]+)` \\| [0-9]{3} \\|").FindAllSubmatch(doc, -1) {
		if !seen[string(m[1])] {
			t.Errorf("docs/contract.md lists code %s, which no answer has", m[1])
		}
	}

	w := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodGet, "http://evil.example/estoc", nil)
	hostguard.Wrap(http.NotFoundHandler(), &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8080}, nil).ServeHTTP(w, r)
	var body svc.ErrorBody
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil || w.Code != http.StatusMisdirectedRequest ||
		body.Code != svc.CodeUnknownHost.String() || body.Field != "Host" || body.Error == "" {
		t.Errorf("Host check: %d %s, want 421 codi %s camp Host", w.Code, w.Body, svc.CodeUnknownHost)
	}
}
