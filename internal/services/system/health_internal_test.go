package system

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/km0/km0/internal/buildinfo"
	"github.com/km0/km0/internal/pgtest"
)

// GET /salut answers 200 while the service's database answers, and 503
// with a short reason (no internals) when it does not or the system stops.
func TestHealthEndpoint(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t, pgtest.URL(), 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := &System{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	check := func(wantCode int, wantState string) {
		t.Helper()
		rec := httptest.NewRecorder()
		s.health("comandes", pool).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, HealthPath, nil))
		var h Health
		if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil {
			t.Fatalf("body %q: %v", rec.Body, err)
		}
		if rec.Code != wantCode || h.Service != "comandes" || h.State != wantState || h.Version != buildinfo.Read().Short() || h.Version == "" {
			t.Fatalf("health: %d %+v, want %d %q", rec.Code, h, wantCode, wantState)
		}
		for _, internal := range []string{"closed", "5432", "postgres"} {
			if strings.Contains(rec.Body.String(), internal) {
				t.Fatalf("health shows %q: %s", internal, rec.Body)
			}
		}
	}
	check(http.StatusOK, "ok")
	pool.Close()
	check(http.StatusServiceUnavailable, "the database does not answer")
	cancel()
	check(http.StatusServiceUnavailable, "stopping")
}
