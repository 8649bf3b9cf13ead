package hostguard_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/km0/km0/internal/hostguard"
)

// Wrap answers only Host names of the server itself, which a web page
// of another site cannot send (DNS rebinding gives it its own name).
func TestHostGuardAnswersOnlyTheServersOwnNames(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	tcp := func(s string) net.Addr { a, _ := net.ResolveTCPAddr("tcp", s); return a }
	cases := []struct {
		listen  string
		allowed []string
		host    string
		want    bool
	}{
		{"127.0.0.1:8080", nil, "127.0.0.1:8080", true},
		{"127.0.0.1:8080", nil, "localhost:8080", true},
		{"127.0.0.1:8080", nil, "LocalHost:8080", true},
		{"127.0.0.1:8080", nil, "[::1]:8080", true},
		{"127.0.0.1:8080", nil, "127.0.0.1:9090", false},
		{"127.0.0.1:8080", nil, "localhost", false},
		{"127.0.0.1:8080", nil, "evil.example:8080", false},
		{"127.0.0.1:8080", nil, "evil.example", false},
		{"127.0.0.1:8080", nil, "", false},
		{"127.0.0.1:8080", nil, "10.0.0.5:8080", false},
		{"127.0.0.1:80", nil, "localhost", true},
		{"[::1]:8080", nil, "[::1]:8080", true},
		{"[::1]:8080", nil, "localhost:8080", true},
		{"10.0.0.5:8080", nil, "10.0.0.5:8080", true},
		{"10.0.0.5:8080", nil, "localhost:8080", false},
		{"10.0.0.5:8080", nil, "10.0.0.6:8080", false},
		{"0.0.0.0:8080", nil, "10.0.0.6:8080", true},
		{"0.0.0.0:8080", nil, "localhost:8080", true},
		{"0.0.0.0:8080", nil, "comandes.intern:8080", false},
		{"0.0.0.0:8080", []string{"comandes.intern"}, "comandes.intern:8080", true},
		{"0.0.0.0:8080", []string{"comandes.intern"}, "Comandes.Intern", true},
		{"0.0.0.0:8080", []string{"comandes.intern:443"}, "comandes.intern:8080", false},
		{"0.0.0.0:8080", []string{"comandes.intern:443"}, "comandes.intern:443", true},
		{"0.0.0.0:8080", []string{" ", ""}, "evil.example:8080", false},
		{"10.0.0.5:8080", []string{"*"}, "evil.example", true},
		{"10.0.0.5:8080", []string{"[fd00::1]"}, "[fd00::1]:8443", true},
		{"10.0.0.5:8080", []string{"[fd00::1]:8443"}, "[fd00::1]:8443", true},
		{"10.0.0.5:8080", []string{"[fd00::1]:8443"}, "[fd00::1]:9000", false},
	}
	for _, c := range cases {
		h := hostguard.Wrap(ok, tcp(c.listen), c.allowed)
		r := httptest.NewRequest(http.MethodGet, "/x", nil)
		r.Host = c.host
		r.Header.Set("Origin", "https://evil.example")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		got := w.Code == http.StatusNoContent
		if got != c.want || (!got && w.Code != http.StatusMisdirectedRequest) {
			t.Errorf("listen %s allowed %v Host %q: got %d, want allowed=%v (else 421)", c.listen, c.allowed, c.host, w.Code, c.want)
		}
		for k := range w.Header() {
			if strings.HasPrefix(k, "Access-Control-") {
				t.Errorf("CORS header %s sent", k)
			}
		}
	}
}
