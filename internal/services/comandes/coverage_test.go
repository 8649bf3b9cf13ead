package comandes_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/outcome"
)

const repartimentTopic = "repartiment.esdeveniments"

// orderTo is good with its delivery city replaced by city.
func orderTo(id, city string) string {
	return `{"id":"` + id + `","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":2,"preu_centims":350}],
		"adreca_lliurament":{"ciutat":"` + city + `","codi_postal":"17001"}}`
}

func (b *bundle) postRaw(t *testing.T, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.srv.URL+"/comandes", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw)
}

// TestUncoveredCityIsRefusedAtCreationFromTheCopyOfTheCoverage: before any
// snapshot every city is accepted; after repartiment.cobertura without
// Perpinyà, an order to it answers 422 with codi ciutat_no_coberta and an
// English message, stores nothing and writes no event, while one to Girona
// (any case) is accepted; an older snapshot redelivered late changes nothing;
// a newer one that adds Perpinyà lets it through.
func TestUncoveredCityIsRefusedAtCreationFromTheCopyOfTheCoverage(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	if st, body := b.postRaw(t, orderTo("P-2026-000001", "Perpinyà")); st != 201 {
		t.Fatalf("before any snapshot: %d %s, want 201", st, body)
	}
	snap := func(rev int64, cities ...string) {
		t.Helper()
		m := svctest.Message(t, repartimentTopic, comandes.TypeCoverage, 1, map[string]any{"ciutats": cities, "revisio": rev})
		if err := svctest.Run(t, b.pool, b.svc.HandleDelivery, m); err != nil {
			t.Fatal(err)
		}
	}
	snap(200, "girona", "vic")
	snap(100, "girona", "perpinyà", "vic") // older, late: ignored
	if cities, rev, err := b.svc.Coverage(ctx); err != nil || rev != 200 || !slices.Equal(cities, []string{"girona", "vic"}) {
		t.Fatalf("copy %v rev %d (%v), want [girona vic] 200", cities, rev, err)
	}
	st, body := b.postRaw(t, orderTo("P-2026-000002", " PERPINYÀ "))
	var e struct{ Error, Camp, Codi string }
	_ = json.Unmarshal([]byte(body), &e)
	if st != http.StatusUnprocessableEntity || e.Codi != "ciutat_no_coberta" || e.Camp != "adreca_lliurament.ciutat" ||
		e.Error != `delivery city " PERPINYÀ " is not covered by repartiment (covered: girona, vic)` {
		t.Fatalf("uncovered: %d %s, want 422 codi ciutat_no_coberta with the English message", st, body)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM comandes WHERE id = 'P-2026-000002'`) + svctest.Count(t, b.pool,
		`SELECT count(*) FROM outbox WHERE agregat_id = 'P-2026-000002'`); n != 0 {
		t.Fatalf("refused order left %d rows, want 0", n)
	}
	if st, body := b.postRaw(t, orderTo("P-2026-000003", "GIRONA")); st != 201 {
		t.Fatalf("covered: %d %s", st, body)
	}
	snap(300, "girona", "perpinyà", "vic")
	if st, body := b.postRaw(t, orderTo("P-2026-000002", "Perpinyà")); st != 201 {
		t.Fatalf("after coverage grew: %d %s", st, body)
	}
	if err := svctest.Run(t, b.pool, b.svc.HandleDelivery, svctest.Message(t, repartimentTopic, comandes.TypeCoverage, 1, map[string]any{"ciutats": []string{}})); !outcome.IsPermanent(err) {
		t.Fatalf("snapshot without revisio: %v, want permanent", err)
	}
}

// TestDeliveryRejectionCancelsTheOrder: repartiment.rebutjat of a paid order
// cancels it with motiu ciutat_no_coberta and writes one comanda.cancellada
// (what pagaments refunds and inventari puts back); a redelivery writes
// nothing more; an unknown order is permanent.
func TestDeliveryRejectionCancelsTheOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	if st, body := b.postRaw(t, orderTo("P-2026-000004", "Figueres")); st != 201 {
		t.Fatalf("create: %d %s", st, body)
	}
	pay := svctest.Message(t, "pagaments.esdeveniments", comandes.TypePaymentConfirmed, 1, comandes.PaymentConfirmed{OrderID: "P-2026-000004", TotalCents: 700, GatewayRef: "ref-1"})
	if err := svctest.Run(t, b.pool, b.svc.HandlePaymentConfirmed, pay); err != nil {
		t.Fatal(err)
	}
	rej := map[string]any{"comanda_id": "P-2026-000004", "motiu": "ciutat_no_coberta", "ciutat": "figueres"}
	for range 2 {
		if err := svctest.Run(t, b.pool, b.svc.HandleDelivery, svctest.Message(t, repartimentTopic, comandes.TypeDeliveryRejected, 1, rej)); err != nil {
			t.Fatal(err)
		}
	}
	v, err := b.svc.Get(ctx, "P-2026-000004")
	if err != nil || v.State != comandes.StateCancelled || v.CancelReason == nil || *v.CancelReason != "ciutat_no_coberta" {
		t.Fatalf("order %+v %v, want cancellada ciutat_no_coberta", v, err)
	}
	var raw []byte
	if err := b.pool.QueryRow(ctx, `SELECT carrega FROM outbox WHERE tipus = 'comanda.cancellada' AND agregat_id = 'P-2026-000004'`).Scan(&raw); err != nil {
		t.Fatalf("comanda.cancellada: %v (want exactly one)", err)
	}
	var c comandes.Cancelled
	if err := json.Unmarshal(raw, &c); err != nil || c.Reason != "ciutat_no_coberta" || c.Previous != "pagada" || c.TotalCents != 700 || c.Detail != "ciutat figueres" {
		t.Fatalf("comanda.cancellada %s", raw)
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.cancellada'`); n != 1 {
		t.Fatalf("%d comanda.cancellada, want 1", n)
	}
	unknown := map[string]any{"comanda_id": "P-2026-999999", "motiu": "ciutat_no_coberta"}
	if err := svctest.Run(t, b.pool, b.svc.HandleDelivery, svctest.Message(t, repartimentTopic, comandes.TypeDeliveryRejected, 1, unknown)); !outcome.IsPermanent(err) {
		t.Fatalf("unknown order: %v, want permanent", err)
	}
}

// An array body to the cancellation endpoint is a 400 that names the JSON
// kinds, never a Go type (comandes.CancelRequest).
func TestCancellationWithAnArrayBodySaysWhatJSONItExpects(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	st, out := b.post(t, "", good)
	if st != 201 {
		t.Fatalf("create: %d", st)
	}
	capability, _ := out["capacitat"].(string)
	st, body := b.cancel(t, capability, "P-2026-000123", "application/json", `[1]`)
	if want := `{"error":"cos: wrong type: expected an object, got array","codi":"camp_invalid","camp":"cos"}` + "\n"; st != 400 || body != want {
		t.Fatalf("array body: %d %q, want 400 %q", st, body, want)
	}
}
