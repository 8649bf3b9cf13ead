package system_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
)

func post(t *testing.T, url, body string) int {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// placeOrder posts an order and returns the status and the capacitat of its 201.
func placeOrder(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Capability string `json:"capacitat"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out.Capability
}

// cancelOrder posts the cancellation of id with the capability cred.
func cancelOrder(t *testing.T, base, id, cred string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/comandes/"+id+"/cancellacio", strings.NewReader(`{"motiu":"client"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+cred)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func orderBody(id, product string, n int) string {
	return fmt.Sprintf(`{"id":%q,"client":"anna","mercat":"girona","linies":[{"producte":%q,"quantitat":%d,"preu_centims":500}],
		"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`, id, product, n)
}

// TestCancellationsAndTheStockRefusalCompensateEveryService runs the six
// services over Kafka:
//   - A (2 formatge-fresc) is served, charged, paid and assigned a courier,
//     then cancelled: stock back to 30, one refund of 1000, courier released;
//   - B (6 formatge-curat, 5 in stock) is refused by inventari: comandes
//     cancels it with motiu estoc_insuficient and pagaments refunds the 3000
//     it charged (or never charges it), stock untouched;
//   - C (1 carbasso) is cancelled while its charge is in retry (the gateway
//     fails its first two attempts): at the end it is charged and refunded
//     once, or never charged;
//
// and analitica counts 3 cancellations, 1 per estoc_insuficient.
func TestCancellationsAndTheStockRefusalCompensateEveryService(t *testing.T) {
	t.Parallel()
	sys, _ := startWith(t, system.Services, func(c *system.Config) {
		c.Backoff = 200 * time.Millisecond
		c.AssignInterval = 100 * time.Millisecond
		c.GatewayFaults = passarella.Faults{Fail: func(key string, attempt int) bool {
			return key == pagaments.ChargeKey("P-2026-000003") && attempt <= 2
		}}
	})
	t.Cleanup(sys.Close)
	ctx := context.Background()
	base := sys.Addrs()["comandes"]
	caps := map[string]string{}
	var st int
	if st, caps["P-2026-000001"] = placeOrder(t, base+"/comandes", orderBody("P-2026-000001", "formatge-fresc", 2)); st != 201 {
		t.Fatalf("A: %d", st)
	}
	testkit.Eventuallyf(t, time.Minute, "A served, charged and assigned", func() (bool, string) {
		st, _ := sys.Inventari.Stock(ctx)
		lz, _ := sys.Repartiment.Summary(ctx)
		pay, _ := sys.Pagaments.Payments(ctx)
		return st["formatge-fresc"] == 28 && lz["assignat"] == 1 && pay["P-2026-000001"].TotalCents == 1000, fmt.Sprintf("stock %v, deliveries %v", st, lz)
	})

	if st := post(t, base+"/comandes", orderBody("P-2026-000002", "formatge-curat", 6)); st != 201 {
		t.Fatalf("B: %d", st)
	}
	if st, caps["P-2026-000003"] = placeOrder(t, base+"/comandes", orderBody("P-2026-000003", "carbasso", 1)); st != 201 {
		t.Fatalf("C: %d", st)
	}
	// C's capability does not cancel (and so refund) A, nor does none.
	for _, cred := range []string{caps["P-2026-000003"], ""} {
		if st := cancelOrder(t, base, "P-2026-000001", cred); st != http.StatusUnauthorized {
			t.Fatalf("cancel A with %q: %d, want 401", cred, st)
		}
	}
	if v, err := sys.Comandes.Get(ctx, "P-2026-000001"); err != nil || v.State == "cancellada" {
		t.Fatalf("A after refused cancellations: %+v %v, want it not cancelled", v, err)
	}
	for _, id := range []string{"P-2026-000001", "P-2026-000003"} {
		if st := cancelOrder(t, base, id, caps[id]); st != 200 {
			t.Fatalf("cancel %s: %d", id, st)
		}
	}
	testkit.Eventuallyf(t, time.Minute, "every order cancelled and compensated", func() (bool, string) {
		var states []string
		for _, id := range []string{"P-2026-000001", "P-2026-000002", "P-2026-000003"} {
			v, err := sys.Comandes.Get(ctx, id)
			if err != nil || v.State != "cancellada" {
				return false, fmt.Sprintf("%s: %v %v", id, v, err)
			}
			states = append(states, v.State)
		}
		st, _ := sys.Inventari.Stock(ctx)
		lz, _ := sys.Repartiment.Summary(ctx)
		refunds, _ := sys.Gateway.Refunds(ctx)
		charges, _ := sys.Gateway.Charges(ctx)
		an, _ := sys.Analitica.Counters(ctx)
		var owed int64
		for _, c := range charges {
			owed += c.TotalCents
		}
		for _, r := range refunds {
			owed -= r.TotalCents
		}
		return st["formatge-fresc"] == 30 && st["formatge-curat"] == 5 && st["carbasso"] == 80 && lz["assignat"] == 0 && lz["cancellat"] >= 1 &&
				owed == 0 && len(refunds) >= 2 && an.PerCancelReason["client"] == 2 && an.PerCancelReason["estoc_insuficient"] == 1,
			fmt.Sprintf("orders %v, stock %v, deliveries %v, charges %d refunds %d owed %d, analitica %v", states, st, lz, len(charges), len(refunds), owed, an.PerCancelReason)
	})

	refunds, _ := sys.Gateway.Refunds(ctx)
	for _, r := range refunds {
		if r.Calls < 1 {
			t.Errorf("refund %+v", r)
		}
	}
	for _, id := range []string{"P-2026-000001", "P-2026-000002"} {
		if _, ok := refunds[pagaments.RefundKey(id)]; !ok {
			t.Errorf("%s not refunded: %v", id, refunds)
		}
	}
	// A was charged (waited for above); B was charged unless its charge
	// attempt failed and its cancellation came first (a slow gateway):
	// charged ⇒ refunded in full and recorded.
	// pagaments records a refund in the transaction that follows the
	// gateway's answer: wait for the record of each charged order.
	charges, _ := sys.Gateway.Charges(ctx)
	testkit.Eventuallyf(t, time.Minute, "pagaments recorded the refunds", func() (bool, string) {
		got, _ := sys.Pagaments.Refunds(ctx)
		for _, id := range []string{"P-2026-000001", "P-2026-000002"} {
			if _, charged := charges[pagaments.ChargeKey(id)]; charged && got[id] == 0 {
				return false, fmt.Sprintf("recorded %v", got)
			}
		}
		return true, ""
	})

	got, _ := sys.Pagaments.Refunds(ctx)
	for id, cents := range map[string]int64{"P-2026-000001": 1000, "P-2026-000002": 3000} {
		_, charged := charges[pagaments.ChargeKey(id)]
		if (id == "P-2026-000001" && !charged) || (charged && got[id] != cents) || (!charged && got[id] != 0) {
			t.Errorf("%s: charged %v, recorded refunds %v; want charged ⇒ refunded %d", id, charged, got, cents)
		}
	}
	// A's courier, and B's if B was paid before its refusal cancelled it:
	// B's release follows its cancellation's event, so it is waited for.
	testkit.Eventuallyf(t, time.Minute, "every assigned courier released, at least A's", func() (bool, string) {
		var released, assigned, busy int
		err := sys.Pool("repartiment").QueryRow(ctx, `SELECT count(*) FILTER (WHERE alliberat), count(*) FILTER (WHERE repartidor_id IS NOT NULL),
			(SELECT count(*) FROM repartidors WHERE ocupat_fins > now()) FROM lliuraments`).Scan(&released, &assigned, &busy)
		return err == nil && released >= 1 && released == assigned && busy == 0,
			fmt.Sprintf("%d released of %d assigned, %d still busy (%v)", released, assigned, busy, err)
	})
}
