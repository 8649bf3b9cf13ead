package system

import (
	"net"
	"net/http"
	"testing"
)

// Every HTTP server Start runs bounds reading, writing and idling, and
// answers only its own Host names plus Config.AllowedHosts and the name it
// was configured with.
func TestHTTPServersHaveTimeoutsAndCheckTheHost(t *testing.T) {
	t.Parallel()
	s := &System{cfg: Config{AllowedHosts: []string{"api.example"}}}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(l.Addr().String())
	srv := s.httpServer("comandes.intern:"+port, l.Addr(), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	}))
	if srv.WriteTimeout <= 0 || srv.ReadTimeout <= 0 || srv.ReadHeaderTimeout <= 0 || srv.IdleTimeout <= 0 {
		t.Fatalf("timeouts: write %v, read %v, header %v, idle %v: want all set", srv.WriteTimeout, srv.ReadTimeout, srv.ReadHeaderTimeout, srv.IdleTimeout)
	}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	for host, want := range map[string]int{
		"127.0.0.1:" + port:       http.StatusNoContent,
		"localhost:" + port:       http.StatusNoContent,
		"api.example":             http.StatusNoContent,
		"comandes.intern:" + port: http.StatusNoContent,
		"evil.example:" + port:    http.StatusMisdirectedRequest,
		"evil.example":            http.StatusMisdirectedRequest,
	} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+l.Addr().String()+"/", nil)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("Host %q: got %d, want %d", host, resp.StatusCode, want)
		}
	}
}
