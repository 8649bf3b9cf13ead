package repartiment_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/outcome"
)

// The refusal of an uncovered city is final (per-key order does not block
// the order's key on it); a schema failure, maps down or a database error
// are not.
func TestFinalIsTheUncoveredCityOnly(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid("P-2026-000010", "Perpinyà")))
	if !repartiment.Final(err) || !outcome.IsPermanent(err) {
		t.Fatalf("Final(%v) = false, want the uncovered city final and permanent", err)
	}
	if got := outcome.Reason(outcome.KindPermanent, err); got != "permanent: ciutat_no_coberta: perpinyà (P-2026-000010)" {
		t.Fatalf("motiu %q", got)
	}
	schema := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid("P-2026-000011", "")))
	for _, err := range []error{schema, outcome.Transient(errors.New("mapes unavailable")), errors.New("57P01")} {
		if repartiment.Final(err) {
			t.Errorf("Final(%q) = true, want false", err)
		}
	}
}

// coverage reads the snapshots of repartiment.cobertura in the outbox, oldest first.
func coverage(t *testing.T, b *bundle) []repartiment.Coverage {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT carrega FROM outbox WHERE tipus = 'repartiment.cobertura' AND agregat = 'cobertura' AND agregat_id = 'repartiment' ORDER BY creat_en, id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []repartiment.Coverage
	for rows.Next() {
		var raw []byte
		var c repartiment.Coverage
		if err := rows.Scan(&raw); err != nil || json.Unmarshal(raw, &c) != nil {
			t.Fatalf("snapshot %s: %v", raw, err)
		}
		out = append(out, c)
	}
	return out
}

// Withdrawing a city publishes a snapshot without it, with a larger
// revisio, in the transaction of the change; a comanda.pagada to it is then
// rejected; a start republishes the same snapshot (same revisio).
func TestSetCoveredPublishesASnapshotAndRejectsTheCity(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	ctx := context.Background()
	first, err := b.svc.PublishCoverage(ctx)
	if err != nil || !slices.Equal(first.Cities, []string{"barcelona", "figueres", "girona", "lleida", "tarragona", "vic"}) || first.Revision <= 0 {
		t.Fatalf("first snapshot %+v %v", first, err)
	}
	if n, err := b.svc.SetCovered(ctx, " Figueres ", false); err != nil || n != 0 {
		t.Fatalf("withdraw figueres: %d rejected, %v", n, err)
	}
	if _, err := b.svc.PublishCoverage(ctx); err != nil { // a restart
		t.Fatal(err)
	}
	snaps := coverage(t, b)
	want := []string{"barcelona", "girona", "lleida", "tarragona", "vic"}
	if len(snaps) != 3 || !slices.Equal(snaps[1].Cities, want) || snaps[1].Revision <= first.Revision || snaps[2].Revision != snaps[1].Revision || !slices.Equal(snaps[2].Cities, want) {
		t.Fatalf("snapshots %+v, want 3: all six, then without figueres (larger revisio), then the same again", snaps)
	}
	err = svctest.Run(t, b.pool, b.svc.HandleOrderPaid, svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid("P-2026-000012", "Figueres")))
	if !repartiment.Final(err) || state(t, b, "P-2026-000012") != repartiment.StateRejected || events(t, b, "repartiment.rebutjat") != 1 {
		t.Fatalf("order to withdrawn figueres: %v, state %q, want rejected with one repartiment.rebutjat", err, state(t, b, "P-2026-000012"))
	}
	if _, err := b.svc.SetCovered(ctx, "", true); err == nil {
		t.Fatal("SetCovered of an empty city: nil error")
	}
}

// A city added without couriers keeps its paid orders pendent; withdrawing
// it rejects them in the same transaction (one repartiment.rebutjat each),
// and leaves the other cities' deliveries alone.
func TestWithdrawingACityRejectsItsPendingDeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	ctx := context.Background()
	if n, err := b.svc.SetCovered(ctx, "Portbou", true); err != nil || n != 0 {
		t.Fatalf("add portbou: %d %v", n, err)
	}
	for i, city := range []string{"Portbou", "Portbou", "Girona"} {
		m := svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid(fmt.Sprintf("P-2026-00002%d", i), city))
		if err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, m); err != nil {
			t.Fatal(err)
		}
	}
	if st := state(t, b, "P-2026-000020"); st != repartiment.StatePending {
		t.Fatalf("portbou order %q, want pendent (no courier)", st)
	}
	n, err := b.svc.SetCovered(ctx, "portbou", false)
	if err != nil || n != 2 {
		t.Fatalf("withdraw portbou: %d rejected, %v; want 2", n, err)
	}
	sum, _ := b.svc.Summary(ctx)
	if sum[repartiment.StateRejected] != 2 || sum[repartiment.StateAssigned] != 1 || sum[repartiment.StatePending] != 0 || events(t, b, "repartiment.rebutjat") != 2 {
		t.Fatalf("deliveries %v, %d repartiment.rebutjat; want 2 rejected (2 events), girona's assigned", sum, events(t, b, "repartiment.rebutjat"))
	}
}
