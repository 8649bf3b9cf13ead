package comandes_test

import (
	"crypto/sha256"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/internal/svctest"
)

// orderN is the good order with id P-2026-00000n.
func orderN(n int) (string, string) {
	id := fmt.Sprintf("P-2026-%06d", n)
	return id, strings.Replace(good, "P-2026-000123", id, 1)
}

// TestAScanWithoutTheCapabilityGetsOne401ForEveryID: a scan of twenty ids
// (three orders, seventeen that do not exist), reading and cancelling each
// with no credential, a wrong one, another scheme and another order's
// capability, gets 401 with one body and one WWW-Authenticate for all 160
// requests; nothing is cancelled and no comanda.cancellada is written.
func TestAScanWithoutTheCapabilityGetsOne401ForEveryID(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	caps := map[string]string{}
	for n := 1; n <= 3; n++ {
		id, body := orderN(n * 5)
		st, out := b.post(t, "", body)
		if st != 201 {
			t.Fatalf("create %s: %d %v", id, st, out)
		}
		caps[id], _ = out["capacitat"].(string)
		if len(caps[id]) != 43 {
			t.Fatalf("capacitat of %s: %q, want 43 characters of base64url", id, caps[id])
		}
	}
	other := caps["P-2026-000015"]
	bodies := map[string]int{}
	for n := 1; n <= 20; n++ {
		id := fmt.Sprintf("P-2026-%06d", n)
		creds := []string{"", "wrong", operatorToken + "x", caps[id] + "A"}
		if id != "P-2026-000015" {
			creds = append(creds, other)
		}
		for _, cred := range creds {
			st, body, www := b.get(t, cred, id)
			if st != http.StatusUnauthorized || www != `Bearer realm="comandes"` {
				t.Fatalf("GET %s with %q: %d %q %s, want 401", id, cred, st, www, body)
			}
			bodies[body]++
			st, body = b.cancel(t, cred, id, "application/json", `{"motiu":"client"}`)
			if st != http.StatusUnauthorized {
				t.Fatalf("cancel %s with %q: %d %s, want 401", id, cred, st, body)
			}
			bodies[body]++
		}
		req, _ := http.NewRequest(http.MethodGet, b.srv.URL+"/comandes/"+id, nil)
		req.Header.Set("Authorization", "Basic "+caps[id]) // the right secret in another scheme
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("GET %s Basic: %d, want 401", id, resp.StatusCode)
		}
	}
	if len(bodies) != 1 {
		t.Fatalf("%d different 401 bodies, want 1: %v", len(bodies), bodies)
	}
	for body, n := range bodies {
		if n != 2*(20*5-1) || strings.Contains(body, "P-2026") {
			t.Fatalf("401 body %q given %d times, want %d and no order id", body, n, 2*(20*5-1))
		}
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM comandes WHERE estat = 'creada'`); n != 3 {
		t.Fatalf("%d orders still creada, want 3", n)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.cancellada'`); n != 0 {
		t.Fatalf("%d comanda.cancellada, want 0", n)
	}
}

// TestOnlyItsOwnCapabilityOrTheOperatorCancelsAPaidOrder: a paid order
// cancelled with another order's capability is refused (401) and stays
// pagada with no comanda.cancellada (pagaments refunds on that event only);
// its own capability cancels it (one comanda.cancellada, estat_anterior
// pagada); the operator token reads and cancels a third order and is told
// 404 for an unknown one. Without Config.OperatorToken the same token is a
// 401.
func TestOnlyItsOwnCapabilityOrTheOperatorCancelsAPaidOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	caps := map[string]string{}
	for n := 1; n <= 3; n++ {
		id, body := orderN(n)
		st, out := b.post(t, "", body)
		if st != 201 {
			t.Fatalf("create %s: %d", id, st)
		}
		caps[id], _ = out["capacitat"].(string)
		m := svctest.Message(t, "pagaments.esdeveniments", comandes.TypePaymentConfirmed, 1, map[string]any{"comanda_id": id, "import_centims": 3200, "ref_passarella": "ch_" + id})
		if err := svctest.Run(t, b.pool, b.svc.HandlePaymentConfirmed, m); err != nil {
			t.Fatal(err)
		}
	}
	if st, body := b.cancel(t, caps["P-2026-000002"], "P-2026-000001", "application/json", `{}`); st != http.StatusUnauthorized {
		t.Fatalf("cancel with another order's capability: %d %s, want 401", st, body)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM comandes WHERE id = 'P-2026-000001' AND estat = 'pagada'`); n != 1 {
		t.Fatalf("order 1 paid: %d, want 1", n)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.cancellada'`); n != 0 {
		t.Fatalf("%d comanda.cancellada (refunds) after a refused cancellation, want 0", n)
	}
	if st, body := b.cancel(t, caps["P-2026-000001"], "P-2026-000001", "application/json", `{}`); st != 200 {
		t.Fatalf("cancel with its own capability: %d %s", st, body)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.cancellada' AND agregat_id = 'P-2026-000001' AND carrega->>'estat_anterior' = 'pagada'`); n != 1 {
		t.Fatalf("%d comanda.cancellada of order 1, want 1", n)
	}
	if st, body, _ := b.get(t, operatorToken, "P-2026-000003"); st != 200 || !strings.Contains(body, `"estat":"pagada"`) {
		t.Fatalf("operator GET: %d %s", st, body)
	}
	if st, body := b.cancel(t, operatorToken, "P-2026-000003", "application/json", `{"motiu":"operador"}`); st != 200 {
		t.Fatalf("operator cancel: %d %s", st, body)
	}
	if st, _ := b.cancel(t, operatorToken, "P-2026-000999", "application/json", `{}`); st != 404 {
		t.Fatalf("operator cancel of an unknown order: %d, want 404", st)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM comandes WHERE estat = 'cancellada'`); n != 2 {
		t.Fatalf("%d orders cancelled, want 2", n)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM comandes WHERE estat = 'pagada'`); n != 1 {
		t.Fatalf("%d orders paid, want 1 (order 2)", n)
	}
	// Operator access is off without Config.OperatorToken.
	offSvc, err := comandes.New(comandes.Config{Pool: b.pool, Outbox: svctest.Outbox(t)})
	if err != nil {
		t.Fatal(err)
	}
	off := &bundle{pool: b.pool, svc: offSvc, srv: httptest.NewServer(offSvc.Handler())}
	t.Cleanup(off.srv.Close)
	if st, _, _ := off.get(t, operatorToken, "P-2026-000002"); st != http.StatusUnauthorized {
		t.Fatalf("operator token with operator access off: %d, want 401", st)
	}
	if st, _, _ := off.get(t, caps["P-2026-000002"], "P-2026-000002"); st != 200 {
		t.Fatalf("capability with operator access off: %d, want 200", st)
	}
}

// TestARetryUnderTheIdempotencyKeyGetsTheSameCapability: the 201 and its
// replay carry the same capacitat, which reads the order; the database holds
// only its SHA-256 and a sealed copy, never the capability itself.
func TestARetryUnderTheIdempotencyKeyGetsTheSameCapability(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	st, first := b.post(t, "k-capacitat", good)
	st2, again := b.post(t, "k-capacitat", good)
	c, _ := first["capacitat"].(string)
	if st != 201 || st2 != 201 || c == "" || again["capacitat"] != c || again["id_esdeveniment"] != first["id_esdeveniment"] {
		t.Fatalf("first %d %v, replay %d %v: want the same capacitat", st, first, st2, again)
	}
	if st, body, _ := b.get(t, c, "P-2026-000123"); st != 200 {
		t.Fatalf("GET with the replayed capability: %d %s", st, body)
	}
	for _, path := range []string{"/comandes", "/comandes/P-2026-000123"} {
		req, _ := http.NewRequest(http.MethodGet, b.srv.URL+path, nil)
		if path == "/comandes" {
			req, _ = http.NewRequest(http.MethodPost, b.srv.URL+path, strings.NewReader(good))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", "k-capacitat")
		}
		req.Header.Set("Authorization", "Bearer "+c)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode/100 != 2 || resp.Header.Get("Cache-Control") != "no-store" {
			t.Fatalf("%s %s: %d, Cache-Control %q, want no-store", req.Method, path, resp.StatusCode, resp.Header.Get("Cache-Control"))
		}
	}
	h := sha256.Sum256([]byte(c))
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM comandes WHERE id = 'P-2026-000123' AND hash_capacitat = $1`, h[:]); n != 1 {
		t.Fatalf("hash_capacitat matches in %d rows, want 1", n)
	}
	for _, q := range []string{`SELECT count(*) FROM comandes c WHERE strpos(row_to_json(c)::text, $1) > 0`,
		`SELECT count(*) FROM peticions_idempotents p WHERE strpos(row_to_json(p)::text, $1) > 0 OR strpos(encode(capacitat_xifrada, 'escape'), $1) > 0`,
		`SELECT count(*) FROM outbox o WHERE strpos(row_to_json(o)::text, $1) > 0`} {
		if n := svctest.Count(t, b.pool, q, c); n != 0 {
			t.Fatalf("%s: %d rows hold the capability in clear", q, n)
		}
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM peticions_idempotents WHERE capacitat_xifrada IS NOT NULL`); n != 1 {
		t.Fatalf("%d sealed capabilities, want 1", n)
	}
}

// TestACancellationMotiuWithBidiOrInvisibleCharactersIsA400: a motiu with a
// bidi override, a zero-width space, a line separator or more than 200 bytes
// is refused naming motiu, and the order stays as it was.
func TestACancellationMotiuWithBidiOrInvisibleCharactersIsA400(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	st, out := b.post(t, "", good)
	if st != 201 {
		t.Fatal(st)
	}
	c, _ := out["capacitat"].(string)
	for _, motiu := range []string{"client\u202egnp.exe", "cli\u200bent", "a\u2028b", "a\u2066b", strings.Repeat("a", 201)} {
		st, body := b.cancel(t, c, "P-2026-000123", "application/json", fmt.Sprintf(`{"motiu":%q}`, motiu))
		if st != 400 || !strings.Contains(body, `"camp":"motiu"`) {
			t.Errorf("motiu %q: %d %s, want 400 naming motiu", motiu, st, body)
		}
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM comandes WHERE estat = 'creada'`); n != 1 {
		t.Fatalf("%d orders creada, want 1", n)
	}
	if st, body := b.cancel(t, c, "P-2026-000123", "application/json", `{"motiu":"canvi d'opinió"}`); st != 200 {
		t.Fatalf("a plain motiu: %d %s", st, body)
	}
}
