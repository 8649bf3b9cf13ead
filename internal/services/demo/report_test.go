package demo

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
)

// startStock starts comandes, inventari and cataleg on a fresh broker and
// fresh databases, dropped at cleanup.
func startStock(t *testing.T) *system.System {
	t.Helper()
	b := kafkatest.New(t, system.DomainTopics()...)
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	cfg := system.Config{DatabaseURL: pgtest.URL(), DatabaseSuffix: "r" + hex.EncodeToString(suffix), Brokers: b.Addrs(),
		Services: []string{comandes.Name, inventari.Name, cataleg.Name}}
	sys, err := system.Start(ctx, cfg)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		names := sys.DatabaseNames()
		sys.Close()
		cancel()
		for _, n := range names {
			_ = svc.DropDatabase(context.Background(), pgtest.URL(), n)
		}
	})
	return sys
}

func invariant(t *testing.T, r *Report, name string) Invariant {
	t.Helper()
	for _, inv := range r.Invariants {
		if inv.Name == name {
			return inv
		}
	}
	t.Fatalf("no invariant %q in %+v", name, r.Invariants)
	return Invariant{}
}

// A broken inventari that dead-letters every cheese order as
// estoc_insuficient while all 5 units are still there: nothing ran out, so
// "only the cheese runs out" must not hold.
func TestOnlyCheeseRunsOutFailsWhenNoCheeseWasServed(t *testing.T) {
	sys := startStock(t)
	ctx := context.Background()
	sub := Submissions{accepted: map[string]string{}}
	var plan []*planned
	insufficient := map[string]bool{}
	var dls []deadLetter
	for i := 1; i <= 3; i++ {
		id := fmt.Sprintf("P-2026-%06d", i)
		cp := sys.Pool(comandes.Name)
		if _, err := cp.Exec(ctx, `INSERT INTO comandes (id, client, mercat, import_centims) VALUES ($1, 'c', 'girona', 2900)`, id); err != nil {
			t.Fatal(err)
		}
		if _, err := cp.Exec(ctx, `INSERT INTO linies_comanda (comanda_id, linia, producte, quantitat, preu_centims) VALUES ($1, 1, $2, 2, 1450)`, id, Cheese); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, &planned{num: i, order: comandes.Order{ID: id}, cheese: true})
		sub.accepted[id] = "e"
		sub.Accepted++
		insufficient[id] = true
		dls = append(dls, deadLetter{topic: comandes.Topic + ".dlq", group: inventari.ConsumerDecrement,
			motiu: "permanent: estoc_insuficient: " + Cheese + " (5 left, 2 asked)", orderID: id})
	}
	r := &Report{}
	if err := reconcileStock(ctx, sys, plan, sub, nil, insufficient, nil, dls, r); err != nil {
		t.Fatal(err)
	}
	if s := r.Stock[Cheese]; s.Final != 5 || s.Accepted != 0 {
		t.Fatalf("setup: cheese %+v, want 5 left and none taken", s)
	}
	if inv := invariant(t, r, onlyCheeseInvariant); inv.OK {
		t.Fatalf("3 cheese orders dead-lettered for estoc_insuficient with 5 units left, yet %q holds: %s", inv.Name, inv.Detail)
	}
}

// A cataleg that holds no flag for a product whose stock changed (its
// consumer skipped the events, or lost its rows) does not agree with
// inventari.
func TestCatalogInvariantFailsWhenTheCatalogMissesAProduct(t *testing.T) {
	sys := startStock(t)
	ctx := context.Background()
	if err := sys.Inventari.Restock(ctx, "carbasso", 3); err != nil {
		t.Fatal(err)
	}
	// Wait for cataleg to learn it, then lose it.
	testkit.Eventuallyf(t, 60*time.Second, "cataleg to get carbasso", func() (bool, string) {
		fs, err := sys.Cataleg.Flags(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return len(fs) == 1 && fs[0].Units == 83, fmt.Sprintf("flags %+v", fs)
	})
	if _, err := sys.Pool(cataleg.Name).Exec(ctx, `DELETE FROM indicadors`); err != nil {
		t.Fatal(err)
	}
	r := &Report{}
	if err := reconcileStock(ctx, sys, nil, Submissions{accepted: map[string]string{}}, map[string]int{"carbasso": 3}, map[string]bool{}, nil, nil, r); err != nil {
		t.Fatal(err)
	}
	if inv := invariant(t, r, stockInvariant); !inv.OK {
		t.Fatalf("setup: stock does not reconcile: %s", inv.Detail)
	}
	if inv := invariant(t, r, catalogInvariant); inv.OK {
		t.Fatalf("carbasso restocked to 83 and absent from cataleg, yet %q holds: %s", inv.Name, inv.Detail)
	}
}

// The charge failure leaves no restart behind, so the check must ask the
// hook: a run whose charge failure never fired does not pass.
func TestInjectedFailuresCheckNeedsTheChargeFailure(t *testing.T) {
	restarts := map[string]int{"relay " + comandes.Name: 1, "consumer " + inventari.ConsumerDecrement: 1}
	for _, tc := range []struct {
		fired bool
		want  bool
	}{{true, true}, {false, false}} {
		r := &Report{Restarts: restarts, Injected: map[string]bool{injectedRelay: true, injectedConsumer: true, injectedCharge: tc.fired}}
		r.checkInjectedFailures(12)
		if inv := invariant(t, r, injectedInvariant); inv.OK != tc.want {
			t.Fatalf("charge failure fired %v: check %v (%s), want %v", tc.fired, inv.OK, inv.Detail, tc.want)
		}
	}
}

// The printed report is tables, not Go values: no "map[" or "[]" in it,
// and the verdict says in words what held, each claim once.
func TestPrintWritesTablesAndAVerdictInWords(t *testing.T) {
	r := &Report{Run: "r1", Database: "test", RequestReply: "Kafka",
		Events:     map[string]TopicCount{comandes.Topic: {OutboxRows: 3, Records: 3, Distinct: 3}},
		DLQ:        map[string]int{inventari.ConsumerDecrement + " · permanent: estoc_insuficient": 38},
		Stock:      map[string]StockLine{Cheese: {Initial: 5, Accepted: 4, Expected: 1, Final: 1, Catalog: 1, LowStock: true}},
		Deliveries: map[string]int{}, Restarts: map[string]int{"relay comandes": 1},
		Compensation: &Compensation{Cancelled: 3, ByReason: map[string]int{comandes.ReasonClient: 2, "estoc_insuficient": 1}},
		Analytics:    &analitica.Counters{PerType: map[string]int64{"comanda.creada": 3}, PerMarket: map[string]int64{}, PerCancelReason: map[string]int64{}},
	}
	r.check("no event lost: a", true, "%s", listOr(nil, "none"))
	r.check("no event lost: b", true, "ok")
	r.check(stockInvariant, true, "products that do not reconcile: %s", listOr(nil, "none"))
	r.OK = true
	var b strings.Builder
	r.Print(&b)
	out := b.String()
	for _, bad := range []string{"map[", "[]", "true", "false"} {
		if strings.Contains(out, bad) {
			t.Errorf("report prints a Go value %q:\n%s", bad, out)
		}
	}
	want := "3 of 3 invariants held: no event lost, stock exact."
	if !strings.Contains(out, want) {
		t.Errorf("verdict: want %q in\n%s", want, out)
	}
	if !regexp.MustCompile(`(?m)^  client\s+2$`).MatchString(out) {
		t.Errorf("cancellations per motiu are not a table:\n%s", out)
	}
	r.Invariants[1].OK = false
	if got, want := verdict(r.Invariants), "NOT RECONCILED: 1 of 3 invariants failed: no event lost: b"; got != want {
		t.Errorf("failed verdict %q, want %q", got, want)
	}
}
