package pagaments_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/km0/km0/internal/services/pagaments/passarella"
)

// The gateway moves money: every route needs its API key, checked before
// the body, and a request without it charges, refunds and shows nothing.
func TestGatewayNeedsItsAPIKey(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	ctx := context.Background()
	good := &passarella.Client{BaseURL: b.url, APIKey: b.gw.APIKey()}
	if _, err := good.Charge(ctx, "cobrament-P-2026-000001", "P-2026-000001", 1450); err != nil {
		t.Fatal(err)
	}
	count := func(table string) int {
		var n int
		if err := b.pool.QueryRow(ctx, "SELECT count(*) FROM passarella."+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	send := func(method, path, auth, body string) int {
		req, _ := http.NewRequest(method, b.url+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "clau-"+path)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var e struct{ Codi, Camp string }
		_ = json.NewDecoder(resp.Body).Decode(&e)
		resp.Body.Close()
		if resp.StatusCode == http.StatusUnauthorized && (e.Codi != "credencial_requerida" || e.Camp != "Authorization") {
			t.Errorf("%s %s with %q: 401 with codi %q camp %q, want credencial_requerida Authorization", method, path, auth, e.Codi, e.Camp)
		}
		return resp.StatusCode
	}
	for _, auth := range []string{"", "Bearer ", "Bearer " + b.gw.APIKey()[:40], "Basic " + b.gw.APIKey(), "Bearer " + b.gw.APIKey() + "x"} {
		if got := send(http.MethodPost, "/cobraments", auth, `{"comanda_id":"P-2026-000002","import_centims":900000}`); got != http.StatusUnauthorized {
			t.Errorf("charge with %q: %d, want 401", auth, got)
		}
		if got := send(http.MethodPost, "/reemborsaments", auth, `{"comanda_id":"P-2026-000001","clau_cobrament":"cobrament-P-2026-000001"}`); got != http.StatusUnauthorized {
			t.Errorf("refund with %q: %d, want 401", auth, got)
		}
		if got := send(http.MethodGet, "/cobraments", auth, ""); got != http.StatusUnauthorized {
			t.Errorf("list with %q: %d, want 401", auth, got)
		}
	}
	if c, r := count("cobraments"), count("reemborsaments"); c != 1 || r != 0 {
		t.Fatalf("%d charges and %d refunds after the requests without the key, want 1 and 0", c, r)
	}
	if got := send(http.MethodGet, "/cobraments", "Bearer "+b.gw.APIKey(), ""); got != http.StatusOK {
		t.Fatalf("list with the key: %d", got)
	}
	// A client with the wrong key is misconfigured: transient (retried),
	// never a refused card that dead-letters the order.
	bad := &passarella.Client{BaseURL: b.url, APIKey: strings.Repeat("k", 32)}
	if _, err := bad.Charge(ctx, "cobrament-P-2026-000003", "P-2026-000003", 100); !errors.Is(err, passarella.ErrUnavailable) || errors.Is(err, passarella.ErrRefused) {
		t.Fatalf("wrong key: %v, want ErrUnavailable and not ErrRefused", err)
	}
	if _, err := passarella.New(passarella.Config{Pool: b.pool, APIKey: "short"}); !errors.Is(err, passarella.ErrShortAPIKey) {
		t.Fatalf("a 5-byte key: %v, want ErrShortAPIKey", err)
	}
}
