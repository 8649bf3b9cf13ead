package pagaments_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/outcome"
)

// An authorisation request that other decoders read differently (the last
// of two members, a member named like a field but for case, invalid UTF-8)
// is refused as permanent and stores no decision.
func TestAuthorizeRefusesAmbiguousBodies(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	for _, body := range []string{
		`{"comanda_id":"P-2026-000001","import_centims":100,"import_centims":999999999}`,
		`{"comanda_id":"P-2026-000001","Comanda_id":"P-2026-000002","import_centims":100}`,
		"{\"comanda_id\":\"P-2026-\xff00001\",\"import_centims\":100}",
		`{"comanda_id":"P-2026-\udc0000001","import_centims":100}`,
	} {
		if _, err := s.Authorize(context.Background(), []byte(body)); !outcome.IsPermanent(err) {
			t.Errorf("%s: got %v, want a permanent error", body, err)
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM autoritzacions"); n != 0 {
		t.Fatalf("ambiguous requests stored %d decisions", n)
	}
}

// A comanda.creada whose dades hold "id" and "ID" is read by encoding/json
// alone as the second order; the charging handler refuses it as permanent
// and charges nothing.
func TestChargeRefusesAmbiguousDades(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	for _, dades := range []string{
		`{"id":"P-2026-000134","ID":"P-2026-999999","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":100}]}`,
		`{"id":"P-2026-000134","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":100,"preu_centims":1}]}`,
	} {
		m := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 1, json.RawMessage(dades))
		if err := svctest.Run(t, b.pool, s.HandleOrderCreated, m); !outcome.IsPermanent(err) || !strings.Contains(err.Error(), "esquema") {
			t.Errorf("%s: got %v, want a permanent esquema error", dades, err)
		}
	}
	if st := b.gw.Stats(); st.Requests != 0 {
		t.Fatalf("ambiguous orders reached the gateway %d times", st.Requests)
	}
}

// The gateway's POST takes JSON only (415 otherwise, nothing charged).
func TestGatewayRefusesBodiesThatAreNotJSON(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	for _, ct := range []string{"", "text/plain", "application/x-www-form-urlencoded"} {
		req, _ := http.NewRequest(http.MethodPost, b.url+"/cobraments", strings.NewReader(`{"comanda_id":"P-2026-000001","import_centims":1}`))
		req.Header.Set("Idempotency-Key", "cobrament-P-2026-000001")
		req.Header.Set("Authorization", "Bearer "+b.gw.APIKey())
		if ct != "" {
			req.Header.Set("Content-Type", ct)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnsupportedMediaType {
			t.Errorf("Content-Type %q: got %d, want 415", ct, resp.StatusCode)
		}
	}
	if st := b.gw.Stats(); st.Requests != 0 {
		t.Fatalf("%d non-JSON requests were charged", st.Requests)
	}
}

// GET /cobraments pages through the charges in key order: limit (default
// 100, at most 1000) and despres_de = the previous page's seguent; every
// charge is listed once.
func TestGatewayListsChargesInPages(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	cl := &passarella.Client{BaseURL: b.url, APIKey: b.gw.APIKey()}
	const n = 205
	for i := range n {
		id := fmt.Sprintf("P-2026-%06d", i)
		if _, err := cl.Charge(context.Background(), pagaments.ChargeKey(id), id, 100); err != nil {
			t.Fatal(err)
		}
	}
	get := func(query string) (int, passarella.Page) {
		req, _ := http.NewRequest(http.MethodGet, b.url+"/cobraments"+query, nil)
		req.Header.Set("Authorization", "Bearer "+b.gw.APIKey())
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var p passarella.Page
		_ = json.NewDecoder(resp.Body).Decode(&p)
		return resp.StatusCode, p
	}
	status, first := get("")
	if status != http.StatusOK || len(first.Charges) != passarella.PageLimitDefault || first.Next == "" {
		t.Fatalf("first page: %d, %d charges, seguent %q; want 200, %d and a cursor", status, len(first.Charges), first.Next, passarella.PageLimitDefault)
	}
	seen := map[string]bool{}
	pages, next := 0, ""
	for {
		q := "?limit=60"
		if next != "" {
			q += "&despres_de=" + next
		}
		status, p := get(q)
		if status != http.StatusOK || len(p.Charges) > 60 {
			t.Fatalf("page %d: %d with %d charges", pages, status, len(p.Charges))
		}
		pages++
		for i, c := range p.Charges {
			if seen[c.Key] || (i > 0 && c.Key <= p.Charges[i-1].Key) {
				t.Fatalf("charge %s listed twice or out of order", c.Key)
			}
			seen[c.Key] = true
		}
		if next = p.Next; next == "" {
			break
		}
	}
	if len(seen) != n || pages != 4 {
		t.Fatalf("listed %d charges in %d pages, want %d in 4", len(seen), pages, n)
	}
	for _, q := range []string{"?limit=0", "?limit=1001", "?limit=x", "?pagina=2"} {
		if status, _ := get(q); status != http.StatusBadRequest {
			t.Errorf("%s: got %d, want 400", q, status)
		}
	}
	if status, p := get("?limit=1000"); status != http.StatusOK || len(p.Charges) != n || p.Next != "" {
		t.Fatalf("limit=1000: %d, %d charges, seguent %q", status, len(p.Charges), p.Next)
	}
}
