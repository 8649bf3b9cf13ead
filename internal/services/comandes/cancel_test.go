package comandes_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/outcome"
)

// cancel posts the cancellation of id with "Authorization: Bearer cred"
// (none if cred is empty).
func (b *bundle) cancel(t *testing.T, cred, id, contentType, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.srv.URL+"/comandes/"+id+"/cancellacio", strings.NewReader(body))
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if cred != "" {
		req.Header.Set("Authorization", "Bearer "+cred)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw)
}

// TestCancellationIsIdempotentAndPublishesOnceWithTheStateChange: the first
// POST cancels (200) and writes one comanda.cancellada in the same
// transaction; three repeats (one with another motiu) answer the same body
// byte for byte and write nothing; an unknown id is 404, a bad id 400, a
// body that is not JSON 415; a payment confirmed after the cancellation
// leaves it cancelled and emits no comanda.pagada.
func TestCancellationIsIdempotentAndPublishesOnceWithTheStateChange(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	st, out := b.post(t, "", good)
	if st != 201 {
		t.Fatalf("create: %d", st)
	}
	capability, _ := out["capacitat"].(string)
	st, first := b.cancel(t, capability, "P-2026-000123", "application/json", `{"motiu":"client"}`)
	if st != 200 {
		t.Fatalf("cancel: %d %s", st, first)
	}
	var c comandes.Cancellation
	if err := json.Unmarshal([]byte(first), &c); err != nil || c.State != "cancellada" || c.Reason != "client" || c.EventID == "" {
		t.Fatalf("cancel body %s (%v)", first, err)
	}
	for _, body := range []string{`{"motiu":"client"}`, `{}`, `{"motiu":"un altre"}`} {
		if st, again := b.cancel(t, capability, "P-2026-000123", "application/json", body); st != 200 || again != first {
			t.Fatalf("repeat %s: %d %s, want 200 %s", body, st, again, first)
		}
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.cancellada' AND agregat_id = 'P-2026-000123' AND id::text = $1`, c.EventID); n != 1 {
		t.Fatalf("%d comanda.cancellada with the answer's id, want 1", n)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.cancellada'`); n != 1 {
		t.Fatalf("%d comanda.cancellada, want 1", n)
	}
	var dades map[string]any
	var raw []byte
	if err := b.pool.QueryRow(t.Context(), `SELECT carrega FROM outbox WHERE tipus = 'comanda.cancellada'`).Scan(&raw); err != nil {
		t.Fatal(err)
	}
	_ = json.Unmarshal(raw, &dades)
	if dades["estat_anterior"] != "creada" || dades["import_centims"] != float64(3200) || dades["motiu"] != "client" {
		t.Fatalf("comanda.cancellada dades %s", raw)
	}
	for _, tc := range []struct {
		id, ct, body string
		want         int
	}{
		{"P-2026-999999", "application/json", `{}`, 404},
		{"X-1", "application/json", `{}`, 400},
		{"P-2026-000123", "text/plain", `{}`, 415},
		{"P-2026-000123", "application/json", `{"motiu":7}`, 400},
		{"P-2026-000123", "application/json", `{"motiu":"a\u0001b"}`, 400},
	} {
		if st, body := b.cancel(t, operatorToken, tc.id, tc.ct, tc.body); st != tc.want {
			t.Errorf("POST %s %s %s: %d %s, want %d", tc.id, tc.ct, tc.body, st, body, tc.want)
		}
	}
	m := svctest.Message(t, "pagaments.esdeveniments", comandes.TypePaymentConfirmed, 1, map[string]any{"comanda_id": "P-2026-000123", "import_centims": 3200, "ref_passarella": "ch_1"})
	if err := svctest.Run(t, b.pool, b.svc.HandlePaymentConfirmed, m); err != nil {
		t.Fatal(err)
	}
	v, err := b.svc.Get(t.Context(), "P-2026-000123")
	if err != nil || v.State != "cancellada" || v.CancelReason == nil || *v.CancelReason != "client" {
		t.Fatalf("after a late payment: %+v %v", v, err)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.pagada'`); n != 0 {
		t.Fatalf("%d comanda.pagada for a cancelled order, want 0", n)
	}
}

// TestStockRefusedCancelsTheOrderOnceWithItsReason: estoc.refusat cancels
// the order (motiu estoc_insuficient) and publishes comanda.cancellada; a
// second refusal changes nothing; an unknown order is permanent.
func TestStockRefusedCancelsTheOrderOnceWithItsReason(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if st, _ := b.post(t, "", good); st != 201 {
		t.Fatalf("create: %d", st)
	}
	refusal := map[string]any{"comanda_id": "P-2026-000123", "motiu": "estoc_insuficient", "detall": "formatge-curat (0 left, 2 asked)"}
	for range 2 {
		m := svctest.Message(t, "inventari.esdeveniments", comandes.TypeStockRefused, 1, refusal)
		if err := svctest.Run(t, b.pool, b.svc.HandleStockRefused, m); err != nil {
			t.Fatal(err)
		}
	}
	v, err := b.svc.Get(t.Context(), "P-2026-000123")
	if err != nil || v.State != "cancellada" || *v.CancelReason != "estoc_insuficient" {
		t.Fatalf("order %+v %v", v, err)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.cancellada' AND carrega->>'motiu' = 'estoc_insuficient'`); n != 1 {
		t.Fatalf("%d comanda.cancellada, want 1", n)
	}
	m := svctest.Message(t, "inventari.esdeveniments", comandes.TypeStockRefused, 1, map[string]any{"comanda_id": "P-2026-000999", "motiu": "estoc_insuficient"})
	if err := svctest.Run(t, b.pool, b.svc.HandleStockRefused, m); !outcome.IsPermanent(err) || !strings.Contains(err.Error(), "comanda_desconeguda") {
		t.Fatalf("unknown order: %v", err)
	}
}

// TestErrorBodiesSayTheCauseInEnglish: an error body names its field
// (camp), says the cause in English, with no Go type name (an array to the
// cancellation endpoint is "wrong type", not "s'esperava
// comandes.CancelRequest"), and carries the stable codi of the cause (the
// table in docs/contract.md); the codes and field names stay as the
// contract spells them.
func TestErrorBodiesSayTheCauseInEnglish(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if st, _ := b.post(t, "", good); st != 201 {
		t.Fatalf("create: %d", st)
	}
	for _, tc := range []struct {
		id, body string
		status   int
		want     string
	}{
		{"P-2026-000123", `[1]`, 400, `{"error":"cos: wrong type: expected an object, got array","codi":"camp_invalid","camp":"cos"}`},
		{"P-2026-000123", `{"motiu":7}`, 400, `{"error":"motiu: wrong type: expected a string, got number","codi":"camp_invalid","camp":"motiu"}`},
		{"P-2026-000123", `{"motiu":"a\u202eb"}`, 400,
			`{"error":"character U+202E at byte 1: no control, format (bidi, zero-width) or separator characters","codi":"camp_invalid","camp":"motiu"}`},
		{"P-2026-999999", `{}`, 404, `{"error":"no order P-2026-999999","codi":"comanda_desconeguda","camp":"id"}`},
		{"X-1", `{}`, 400, `{"error":"\"X-1\" is not of the form P-YYYY-NNNNNN","codi":"id_invalid","camp":"id"}`},
	} {
		st, body := b.cancel(t, operatorToken, tc.id, "application/json", tc.body)
		if st != tc.status || strings.TrimSpace(body) != tc.want {
			t.Errorf("POST /comandes/%s/cancellacio %s: %d %s, want %d %s", tc.id, tc.body, st, body, tc.status, tc.want)
		}
	}
	if st, body := b.cancel(t, "", "P-2026-000123", "application/json", `{}`); st != 401 || strings.TrimSpace(body) !=
		`{"error":"a credential is required: Authorization: Bearer \u003cthe order's capacitat, or the operator token\u003e","codi":"credencial_requerida","camp":"Authorization"}` {
		t.Errorf("cancel without a credential: %d %s", st, body)
	}
	if st, body := b.cancel(t, operatorToken, "P-2026-000123", "text/plain", `{}`); st != 415 || strings.TrimSpace(body) !=
		`{"error":"the body must be application/json (UTF-8)","codi":"cos_no_json","camp":"Content-Type"}` {
		t.Errorf("cancel as text/plain: %d %s", st, body)
	}
	for _, tc := range []struct{ body, code, field, want string }{
		{`{"id":"P-2026-000001","client":"anna","mercat":"paris","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`,
			"mercat_desconegut", "mercat", `mercat: unknown market "paris" (known: `},
		{`{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[]}`, "camp_invalid", "linies", `linies: the order has no line`},
		{`{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":0,"preu_centims":1}]}`,
			"camp_invalid", "linies[0].quantitat", `linies[0].quantitat: must be positive, is 0`},
		{`{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"unicorn","quantitat":1,"preu_centims":1}]}`,
			"producte_desconegut", "linies[0].producte", `linies[0].producte: unknown product "unicorn": inventari does not stock it`},
		{`{"id":"P-1","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`,
			"id_invalid", "id", `id: "P-1" is not of the form P-YYYY-NNNNNN`},
		{`{"id":"P-2026-000001","client":"anna"`, "camp_invalid", "cos", `cos: `},
		{good, "comanda_existent", "id", `an order P-2026-000123 already exists`},
	} {
		st, out := b.post(t, "", tc.body)
		msg, _ := out["error"].(string)
		if st/100 != 4 || !strings.HasPrefix(msg, tc.want) || out["codi"] != tc.code || out["camp"] != tc.field {
			t.Errorf("POST /comandes %s: %d %v, want codi %s, camp %s, %q…", tc.body, st, out, tc.code, tc.field, tc.want)
		}
	}
}
