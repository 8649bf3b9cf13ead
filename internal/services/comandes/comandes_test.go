package comandes_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
)

type bundle struct {
	pool *pgxpool.Pool
	svc  *comandes.Service
	srv  *httptest.Server
}

func setup(t *testing.T, auth comandes.Authorizer) *bundle {
	t.Helper()
	pool, _ := svctest.DB(t, migrate.Outbox, migrate.Inbox, comandes.Migrations)
	s, err := comandes.New(comandes.Config{Pool: pool, Authorizer: auth, Outbox: svctest.Outbox(t), OperatorToken: operatorToken})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(srv.Close)
	return &bundle{pool: pool, svc: s, srv: srv}
}

// operatorToken is the Config.OperatorToken of setup's service.
const operatorToken = "operador-de-prova-0123456789abcdef"

// get reads GET /comandes/{id} with "Authorization: Bearer cred" (none if
// cred is empty) and returns the status, the body and the answer's
// WWW-Authenticate.
func (b *bundle) get(t *testing.T, cred, id string) (int, string, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, b.srv.URL+"/comandes/"+id, nil)
	if cred != "" {
		req.Header.Set("Authorization", "Bearer "+cred)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw), resp.Header.Get("WWW-Authenticate")
}

func (b *bundle) post(t *testing.T, key, body string) (int, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.srv.URL+"/comandes", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out
}

const good = `{"id":"P-2026-000123","client":"anna","mercat":"girona","extra":"ignored",
 "linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450},{"producte":"carbasso","quantitat":1,"preu_centims":300}],
 "adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`

func TestPostRejectsBadInputNamingTheField(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	cases := []struct{ name, body, field string }{
		{"malformed JSON", `{"id":`, "cos"},
		{"not an object", `[1,2]`, "cos"},
		{"missing id", `{"client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`, "id"},
		{"malformed id", `{"id":"X-1","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`, "id"},
		{"id of wrong type", `{"id":7,"client":"anna","mercat":"girona","linies":[]}`, "id"},
		{"missing client", `{"id":"P-2026-000001","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`, "client"},
		{"unknown market", `{"id":"P-2026-000001","client":"anna","mercat":"paris","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`, "mercat"},
		{"empty lines", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[]}`, "linies"},
		{"no lines", `{"id":"P-2026-000001","client":"anna","mercat":"girona"}`, "linies"},
		{"zero quantity", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":0,"preu_centims":1}]}`, "linies[0].quantitat"},
		{"negative quantity", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1},{"producte":"carbasso","quantitat":-2,"preu_centims":1}]}`, "linies[1].quantitat"},
		{"fractional quantity", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1.5,"preu_centims":1}]}`, "linies.quantitat"},
		{"negative price", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":-1}]}`, "linies[0].preu_centims"},
		{"empty product", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"quantitat":1,"preu_centims":1}]}`, "linies[0].producte"},
		{"bad postal code", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}],"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17"}}`, "adreca_lliurament.codi_postal"},
		{"empty city", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}],"adreca_lliurament":{"codi_postal":"17001"}}`, "adreca_lliurament.ciutat"},
		// PostgreSQL refuses NUL in text: without a 400 these were a 503 "retry" that never succeeds.
		{"NUL in client", `{"id":"P-2026-000001","client":"an\u0000na","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`, "client"},
		// encoding/json alone would store U+FFFD for these, with a 201.
		{"raw invalid UTF-8 in client", "{\"id\":\"P-2026-000001\",\"client\":\"an\xff\xfena\",\"mercat\":\"girona\",\"linies\":[{\"producte\":\"carbasso\",\"quantitat\":1,\"preu_centims\":1}]}", "client"},
		{"lone surrogate in client", `{"id":"P-2026-000001","client":"an\ud800na","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`, "client"},
		{"invalid UTF-8 in a product", "{\"id\":\"P-2026-000001\",\"client\":\"anna\",\"mercat\":\"girona\",\"linies\":[{\"producte\":\"carbasso\",\"quantitat\":1,\"preu_centims\":1},{\"producte\":\"ca\xc3\",\"quantitat\":1,\"preu_centims\":1}]}", "linies[1].producte"},
		// encoding/json alone would take the last, or the case-folded, member: another reader takes the first.
		{"case variant of id", `{"id":"P-2026-000134","ID":"P-2026-999999","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`, "ID"},
		{"repeated id", `{"id":"P-2026-000134","client":"anna","mercat":"girona","id":"P-2026-999999","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}]}`, "id"},
		{"repeated quantity", `{"id":"P-2026-000134","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"quantitat":9,"preu_centims":1}]}`, "linies[0].quantitat"},
		{"NUL in city", `{"id":"P-2026-000001","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":1}],"adreca_lliurament":{"ciutat":"Gi\u0000rona","codi_postal":"17001"}}`, "adreca_lliurament.ciutat"},
	}
	for _, c := range cases {
		status, out := b.post(t, "", c.body)
		if status != http.StatusBadRequest || out["camp"] != c.field {
			t.Errorf("%s: got %d %v, want 400 naming %q", c.name, status, out, c.field)
		}
	}
	// An Idempotency-Key that is not valid UTF-8 (obs-text in the header) cannot be stored.
	req, _ := http.NewRequest(http.MethodPost, b.srv.URL+"/comandes", strings.NewReader(good))
	req.Header.Set("Content-Type", "application/json")
	req.Header["Idempotency-Key"] = []string{"cl\xe9"}
	if resp, err := http.DefaultClient.Do(req); err != nil {
		t.Fatal(err)
	} else {
		var out map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || out["camp"] != "Idempotency-Key" || out["codi"] != "clau_idempotencia_invalida" {
			t.Errorf("non-UTF-8 Idempotency-Key: got %d %v, want 400 clau_idempotencia_invalida naming Idempotency-Key", resp.StatusCode, out)
		}
	}
	big := `{"id":"P-2026-000001","client":"` + strings.Repeat("a", comandes.MaxBodyBytesDefault) + `"}`
	if status, out := b.post(t, "", big); status != http.StatusRequestEntityTooLarge || out["codi"] != "cos_massa_gran" {
		t.Errorf("body too large: got %d %v, want 413 cos_massa_gran", status, out)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM comandes"); n != 0 {
		t.Fatalf("bad input created %d orders", n)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("bad input wrote %d events", n)
	}
}

// A web page can make a browser POST cross-site without a preflight only as
// text/plain, a form or multipart: each is refused with 415 and stores
// nothing, and no answer carries a CORS header that would let the page read it.
func TestPostRefusesBodiesThatAreNotJSON(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, ct := range []string{"", "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
		"multipart/form-data; boundary=x", "application/json; charset=latin1", "application/jsonx", "application/json; x=1"} {
		req, _ := http.NewRequest(http.MethodPost, b.srv.URL+"/comandes", strings.NewReader(good))
		if ct != "" {
			req.Header.Set("Content-Type", ct)
		}
		req.Header.Set("Origin", "https://evil.example")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var out map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnsupportedMediaType || out["camp"] != "Content-Type" || out["codi"] != "cos_no_json" {
			t.Errorf("Content-Type %q: got %d %v, want 415 cos_no_json naming Content-Type", ct, resp.StatusCode, out)
		}
		for k := range resp.Header {
			if strings.HasPrefix(k, "Access-Control-") {
				t.Errorf("Content-Type %q: CORS header %s sent", ct, k)
			}
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM comandes"); n != 0 {
		t.Fatalf("non-JSON bodies created %d orders", n)
	}
	// A preflight is not granted: no CORS header, not a 2xx.
	pre, _ := http.NewRequest(http.MethodOptions, b.srv.URL+"/comandes", nil)
	pre.Header.Set("Origin", "https://evil.example")
	pre.Header.Set("Access-Control-Request-Method", "POST")
	pre.Header.Set("Access-Control-Request-Headers", "content-type")
	if resp, err := http.DefaultClient.Do(pre); err != nil {
		t.Fatal(err)
	} else {
		resp.Body.Close()
		for k := range resp.Header {
			if strings.HasPrefix(k, "Access-Control-") {
				t.Errorf("preflight: CORS header %s sent", k)
			}
		}
		if resp.StatusCode < 300 {
			t.Errorf("preflight: got %d, want no success", resp.StatusCode)
		}
	}
	// application/json (with charset utf-8) is accepted, and still no CORS header.
	for i, ct := range []string{"application/json", "Application/JSON; charset=UTF-8"} {
		body := strings.Replace(good, "P-2026-000123", fmt.Sprintf("P-2026-00012%d", i), 1)
		req, _ := http.NewRequest(http.MethodPost, b.srv.URL+"/comandes", strings.NewReader(body))
		req.Header.Set("Content-Type", ct)
		req.Header.Set("Origin", "https://evil.example")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Errorf("Content-Type %q: got %d, want 201", ct, resp.StatusCode)
		}
		for k := range resp.Header {
			if strings.HasPrefix(k, "Access-Control-") {
				t.Errorf("CORS header %s sent", k)
			}
		}
	}
}

func TestPostWritesOrderLinesAndEventInOneTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	status, out := b.post(t, "", good)
	if status != http.StatusCreated || out["import_centims"] != float64(3200) || out["versio"] != float64(2) {
		t.Fatalf("got %d %v", status, out)
	}
	capability, _ := out["capacitat"].(string)
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM linies_comanda WHERE comanda_id = 'P-2026-000123'"); n != 2 {
		t.Fatalf("lines %d", n)
	}
	var carrega []byte
	var versio int
	if err := b.pool.QueryRow(context.Background(), `SELECT versio, carrega FROM outbox WHERE agregat = 'comanda'
		AND agregat_id = 'P-2026-000123' AND tipus = 'comanda.creada' AND id::text = $1`, out["id_esdeveniment"]).Scan(&versio, &carrega); err != nil {
		t.Fatal(err)
	}
	var o comandes.Order
	if err := json.Unmarshal(carrega, &o); err != nil || versio != 2 || o.Address == nil || o.Address.City != "Girona" || len(o.Lines) != 2 {
		t.Fatalf("event v%d %s (%v)", versio, carrega, err)
	}
	// A legacy client without an address produces a versio 1 event.
	legacy := strings.Replace(strings.Replace(good, "000123", "000124", 1), `,
 "adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}`, "", 1)
	if status, out := b.post(t, "", legacy); status != http.StatusCreated || out["versio"] != float64(1) {
		t.Fatalf("legacy: %d %v", status, out)
	}
	// The same id again, without a key, is a conflict and writes nothing.
	if status, out := b.post(t, "", good); status != http.StatusConflict || out["camp"] != "id" {
		t.Fatalf("duplicate id: %d %v", status, out)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM outbox"); n != 2 {
		t.Fatalf("outbox rows %d, want 2", n)
	}
	// GET returns the order to its capability; an unknown one is 404 to the operator.
	st, raw, _ := b.get(t, capability, "P-2026-000123")
	var v comandes.OrderView
	_ = json.Unmarshal([]byte(raw), &v)
	if st != 200 || v.State != "creada" || v.TotalCents != 3200 || len(v.Lines) != 2 {
		t.Fatalf("GET: %d %+v", st, v)
	}
	if st, _, _ := b.get(t, operatorToken, "P-2026-999999"); st != 404 {
		t.Fatalf("GET unknown: %d", st)
	}
}

func TestIdempotencyKeyReplaysTheFirstAnswerAndCreatesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// Eight concurrent submissions of the same order with the same key.
	var wg sync.WaitGroup
	ids := make([]string, 8)
	codes := make([]int, 8)
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			status, out := b.post(t, "clau-1", good)
			codes[i], ids[i] = status, fmt.Sprint(out["id_esdeveniment"])
		}()
	}
	wg.Wait()
	for i := range ids {
		if codes[i] != http.StatusCreated || ids[i] != ids[0] {
			t.Fatalf("submission %d: %d %s, want 201 %s", i, codes[i], ids[i], ids[0])
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM outbox"); n != 1 {
		t.Fatalf("outbox rows %d, want 1", n)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM linies_comanda"); n != 2 {
		t.Fatalf("lines %d, want 2", n)
	}
	// The same key with another body is refused.
	other := strings.Replace(good, `"quantitat":2`, `"quantitat":3`, 1)
	if status, out := b.post(t, "clau-1", other); status != http.StatusUnprocessableEntity || out["camp"] != "Idempotency-Key" || out["codi"] != "clau_idempotencia_reutilitzada" {
		t.Fatalf("reused key: %d %v", status, out)
	}
}

type authFunc func(ctx context.Context, id string, cents int64) error

func (f authFunc) Authorize(ctx context.Context, id string, cents int64) error {
	return f(ctx, id, cents)
}

func TestAuthorisationRefusedIs402AndUnavailableIs503(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	answer := fmt.Errorf("targeta caducada: %w", comandes.ErrRefused)
	b := setup(t, authFunc(func(_ context.Context, id string, cents int64) error {
		mu.Lock()
		defer mu.Unlock()
		if id != "P-2026-000123" || cents != 3200 {
			return fmt.Errorf("unexpected request %s %d", id, cents)
		}
		return answer
	}))
	want402 := map[string]any{"error": "payment refused: targeta caducada: comandes: payment refused", "codi": "pagament_refusat", "camp": "targeta"}
	if status, out := b.post(t, "k-402", good); status != http.StatusPaymentRequired || !maps.Equal(out, want402) {
		t.Fatalf("refused: %d %v, want 402 %v", status, out, want402)
	}
	mu.Lock()
	answer = errors.New("timeout waiting for pagaments")
	mu.Unlock()
	if status, out := b.post(t, "k-503", good); status != http.StatusServiceUnavailable || out["codi"] != "no_disponible" {
		t.Fatalf("unavailable: %d %v, want 503 no_disponible", status, out)
	}
	mu.Lock()
	answer = nil
	mu.Unlock()
	// The refusal was the first answer for k-402: it is replayed.
	if status, out := b.post(t, "k-402", good); status != http.StatusPaymentRequired || !maps.Equal(out, want402) {
		t.Fatalf("replayed refusal: %d %v, want the first answer", status, out)
	}
	// A 503 is not stored: the retry with k-503 succeeds.
	if status, _ := b.post(t, "k-503", good); status != http.StatusCreated {
		t.Fatalf("retry after 503: %d", status)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM comandes"); n != 1 {
		t.Fatalf("orders %d, want 1", n)
	}
}

// An id already taken is a 409 whatever the authoriser would say: pagaments
// refuses a second amount for an order it approved ("import_diferent"), and
// that must not turn a duplicate id into a 402 stored under a new key.
func TestDuplicateIDIs409BeforeAuthorisation(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	approved := map[string]int64{}
	b := setup(t, authFunc(func(_ context.Context, id string, cents int64) error {
		mu.Lock()
		defer mu.Unlock()
		if c, ok := approved[id]; ok && c != cents {
			return fmt.Errorf("import_diferent: %w", comandes.ErrRefused)
		}
		approved[id] = cents
		return nil
	}))
	if status, out := b.post(t, "k-1", good); status != http.StatusCreated {
		t.Fatalf("first: %d %v", status, out)
	}
	other := strings.Replace(good, `"quantitat":2`, `"quantitat":3`, 1)
	for _, key := range []string{"", "k-2"} {
		if status, out := b.post(t, key, other); status != http.StatusConflict || out["camp"] != "id" {
			t.Fatalf("same id, other body, key %q: %d %v, want 409", key, status, out)
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM peticions_idempotents WHERE clau = 'k-2'"); n != 0 {
		t.Fatalf("the 409 was stored under k-2")
	}
}

func TestPaymentConfirmedMarksPaidAndEmitsComandaPagadaOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if status, _ := b.post(t, "", good); status != http.StatusCreated {
		t.Fatal(status)
	}
	h := b.svc.HandlePaymentConfirmed
	m := svctest.Message(t, "pagaments.esdeveniments", comandes.TypePaymentConfirmed, 1,
		comandes.PaymentConfirmed{OrderID: "P-2026-000123", TotalCents: 3200, GatewayRef: "ch_1"})
	for range 2 { // a second confirmation (another event id) changes nothing
		if err := svctest.Run(t, b.pool, h, m); err != nil {
			t.Fatal(err)
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM comandes WHERE estat = 'pagada'"); n != 1 {
		t.Fatalf("paid %d", n)
	}
	var versio int
	var carrega []byte
	if err := b.pool.QueryRow(context.Background(), `SELECT versio, carrega FROM outbox WHERE tipus = 'comanda.pagada'`).Scan(&versio, &carrega); err != nil {
		t.Fatalf("exactly one comanda.pagada expected: %v", err)
	}
	if versio != 1 || !bytes.Contains(carrega, []byte(`"ciutat": "Girona"`)) || !bytes.Contains(carrega, []byte(`"comanda_id": "P-2026-000123"`)) {
		t.Fatalf("comanda.pagada v%d %s", versio, carrega)
	}
	unknown := svctest.Message(t, "pagaments.esdeveniments", comandes.TypePaymentConfirmed, 1, comandes.PaymentConfirmed{OrderID: "P-2026-000999"})
	if err := svctest.Run(t, b.pool, h, unknown); !outcome.IsPermanent(err) || !strings.Contains(err.Error(), "comanda_desconeguda") {
		t.Fatalf("unknown order: %v", err)
	}
	bad := svctest.Message(t, "pagaments.esdeveniments", comandes.TypePaymentConfirmed, 1, map[string]any{"import_centims": 1})
	if err := svctest.Run(t, b.pool, h, bad); !outcome.IsPermanent(err) {
		t.Fatalf("no comanda_id: %v", err)
	}
}

// A request that died between claiming its Idempotency-Key and answering
// (SIGKILL there leaves exactly this row: the claim commits on its own) holds
// the key until its lease passes; then a retry with the key runs afresh and
// creates the order once. Meanwhile another body under the key is a 422.
func TestAClaimLeftByADeadRequestIsTakenOverAfterItsLease(t *testing.T) {
	t.Parallel()
	pool, _ := svctest.DB(t, migrate.Outbox, migrate.Inbox, comandes.Migrations)
	s, err := comandes.New(comandes.Config{Pool: pool, Outbox: svctest.Outbox(t), KeyLease: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(srv.Close)
	b := &bundle{pool: pool, svc: s, srv: srv}
	sum := sha256.Sum256([]byte(good))
	if _, err := pool.Exec(context.Background(), `INSERT INTO peticions_idempotents (clau, hash_peticio, estat_http, resposta, titular, reservada_fins)
		VALUES ('k-mort', $1, 0, 'null', 'un procés mort', now() + interval '300 milliseconds')`, hex.EncodeToString(sum[:])); err != nil {
		t.Fatal(err)
	}
	other := strings.Replace(good, `"quantitat":2`, `"quantitat":3`, 1)
	if status, out := b.post(t, "k-mort", other); status != http.StatusUnprocessableEntity {
		t.Fatalf("another body under a held key: %d %v, want 422", status, out)
	}
	status, out := b.post(t, "k-mort", good)
	if status != http.StatusCreated {
		t.Fatalf("retry after the lease: %d %v, want 201", status, out)
	}
	if again, out2 := b.post(t, "k-mort", good); again != http.StatusCreated || out2["id_esdeveniment"] != out["id_esdeveniment"] {
		t.Fatalf("replay: %d %v, want the 201 of %v", again, out2, out["id_esdeveniment"])
	}
	if n := svctest.Count(t, pool, "SELECT count(*) FROM outbox"); n != 1 {
		t.Fatalf("outbox rows %d, want 1", n)
	}
}

// A pagament.confirmat whose dades another decoder reads as another order
// (a repeated comanda_id, or "Comanda_id" besides it) is a permanent
// "esquema" error and marks nothing paid.
func TestPaymentConfirmedRefusesAmbiguousDades(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if status, _ := b.post(t, "", good); status != http.StatusCreated {
		t.Fatal(status)
	}
	for _, d := range []string{
		`{"comanda_id":"P-2026-000999","comanda_id":"P-2026-000123","import_centims":3200,"ref_passarella":"ch_1"}`,
		`{"Comanda_id":"P-2026-000123","comanda_id":"P-2026-000999","import_centims":3200,"ref_passarella":"ch_1"}`,
	} {
		m := svctest.Message(t, "pagaments.esdeveniments", comandes.TypePaymentConfirmed, 1, json.RawMessage(d))
		if err := svctest.Run(t, b.pool, b.svc.HandlePaymentConfirmed, m); !outcome.IsPermanent(err) || !strings.Contains(err.Error(), "esquema") {
			t.Errorf("%s: got %v, want a permanent esquema error", d, err)
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM comandes WHERE estat = 'pagada'"); n != 0 {
		t.Fatalf("ambiguous confirmations marked %d orders paid", n)
	}
}
