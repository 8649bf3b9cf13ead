package system_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
)

func orderTo(id, city string) string {
	return fmt.Sprintf(`{"id":%q,"client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":3,"preu_centims":400}],
		"adreca_lliurament":{"ciutat":%q,"codi_postal":"17600"}}`, id, city)
}

// postBody posts body to url and returns the status and the answer.
func postBody(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw)
}

// TestUncoveredCityIsRefusedAtCreationAndARejectionAfterAcceptanceIsRefunded
// runs the six services over Kafka:
//   - once comandes has repartiment's coverage (repartiment.cobertura), an
//     order to Perpinyà answers 422 codi ciutat_no_coberta: nothing charged;
//   - X to Figueres is accepted, then repartiment stops covering Figueres
//     before X is paid (the gateway fails X's charge until then): repartiment
//     rejects X (repartiment.rebutjat, letter ciutat_no_coberta), comandes
//     cancels it (motiu ciutat_no_coberta), pagaments refunds the 1200 it
//     charged, inventari puts the 3 carbasso back, and repartiment applies
//     X's comanda.cancellada behind the rejection: no key blocked, nothing
//     parked or dead-lettered as blocked (morta_per_bloqueig);
//   - comandes's copy then lacks Figueres: a new order to it is refused.
func TestUncoveredCityIsRefusedAtCreationAndARejectionAfterAcceptanceIsRefunded(t *testing.T) {
	t.Parallel()
	const x = "P-2026-000031"
	var withdrawn atomic.Bool
	sys, _ := startWith(t, system.Services, func(c *system.Config) {
		c.Backoff = 200 * time.Millisecond
		c.AssignInterval = 100 * time.Millisecond
		c.GatewayFaults = passarella.Faults{Fail: func(key string, attempt int) bool {
			return key == pagaments.ChargeKey(x) && !withdrawn.Load()
		}}
	})
	t.Cleanup(sys.Close)
	ctx := context.Background()
	base := sys.Addrs()["comandes"]
	testkit.Eventuallyf(t, time.Minute, "comandes has repartiment's coverage", func() (bool, string) {
		cities, rev, err := sys.Comandes.Coverage(ctx)
		return rev > 0 && len(cities) == 6, fmt.Sprintf("%v rev %d %v", cities, rev, err)
	})

	st, body := postBody(t, base+"/comandes", orderTo("P-2026-000030", "Perpinyà"))
	var e struct{ Codi, Camp, Error string }
	if _ = json.Unmarshal([]byte(body), &e); st != http.StatusUnprocessableEntity || e.Codi != "ciutat_no_coberta" || e.Camp != "adreca_lliurament.ciutat" ||
		e.Error != `delivery city "Perpinyà" is not covered by repartiment (covered: barcelona, figueres, girona, lleida, tarragona, vic)` {
		t.Fatalf("Perpinyà: %d %s, want 422 codi ciutat_no_coberta", st, body)
	}
	if st, body := postBody(t, base+"/comandes", orderTo(x, "Figueres")); st != 201 {
		t.Fatalf("X: %d %s", st, body)
	}
	if _, err := sys.Repartiment.SetCovered(ctx, "figueres", false); err != nil {
		t.Fatal(err)
	}
	withdrawn.Store(true)
	var cancelEvent string
	testkit.Eventuallyf(t, time.Minute, "X rejected, cancelled, refunded, stock back", func() (bool, string) {
		v, err := sys.Comandes.Get(ctx, x)
		if err != nil || v.State != "cancellada" || v.CancelReason == nil || *v.CancelReason != "ciutat_no_coberta" {
			return false, fmt.Sprintf("X %+v %v", v, err)
		}
		charges, _ := sys.Gateway.Charges(ctx)
		refunds, _ := sys.Gateway.Refunds(ctx)
		booked, _ := sys.Pagaments.Refunds(ctx)
		stock, _ := sys.Inventari.Stock(ctx)
		lz, _ := sys.Repartiment.Summary(ctx)
		_ = sys.Pool("comandes").QueryRow(ctx, `SELECT esdeveniment_cancellacio FROM comandes WHERE id = $1`, x).Scan(&cancelEvent)
		var applied int
		_ = sys.Pool("repartiment").QueryRow(ctx, `SELECT count(*) FROM missatges_processats WHERE consumidor = 'repartiment.assignacio' AND id_missatge = $1`, cancelEvent).Scan(&applied)
		return charges[pagaments.ChargeKey(x)].TotalCents == 1200 && refunds[pagaments.RefundKey(x)].TotalCents == 1200 && booked[x] == 1200 &&
				stock["carbasso"] == 80 && lz["rebutjat"] == 1 && lz["assignat"] == 0 && applied == 1,
			fmt.Sprintf("charges %v refunds %v booked %v stock %d deliveries %v cancellation applied by repartiment %d",
				charges, refunds, booked, stock["carbasso"], lz, applied)
	})

	testkit.Eventuallyf(t, time.Minute, "analitica counted the cancellation under its motiu", func() (bool, string) {
		an, err := sys.Analitica.Counters(ctx)
		return an.PerCancelReason["ciutat_no_coberta"] == 1 && an.PerCancelReason["altres"] == 0, fmt.Sprintf("%v %v", an.PerCancelReason, err)
	})

	var blocked, parked, letters int
	rp := sys.Pool("repartiment")
	if err := rp.QueryRow(ctx, `SELECT (SELECT count(*) FROM claus_bloquejades), (SELECT count(*) FROM missatges_aparcats),
		(SELECT count(*) FROM alertes)`).Scan(&blocked, &parked, &letters); err != nil || blocked != 0 || parked != 0 || letters != 0 {
		t.Fatalf("repartiment: %d keys blocked, %d messages parked, %d alerts (%v); want 0, 0, 0", blocked, parked, letters, err)
	}
	charges, _ := sys.Gateway.Charges(ctx)
	if _, ok := charges[pagaments.ChargeKey("P-2026-000030")]; ok || len(charges) != 1 {
		t.Fatalf("charges %v, want X's only (Perpinyà refused before any charge)", charges)
	}
	testkit.Eventuallyf(t, time.Minute, "comandes's copy without figueres", func() (bool, string) {
		cities, _, err := sys.Comandes.Coverage(ctx)
		return len(cities) == 5 && !strings.Contains(strings.Join(cities, ","), "figueres"), fmt.Sprintf("%v %v", cities, err)
	})

	if st, body := postBody(t, base+"/comandes", orderTo("P-2026-000032", "Figueres")); st != http.StatusUnprocessableEntity || !strings.Contains(body, `"codi":"ciutat_no_coberta"`) {
		t.Fatalf("Figueres after the change: %d %s, want 422", st, body)
	}
}
