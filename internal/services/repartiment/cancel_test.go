package repartiment_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/repartiment"
)

func courierOf(t *testing.T, b *bundle, id string) (string, bool) {
	t.Helper()
	var c string
	var busy bool
	if err := b.pool.QueryRow(context.Background(), `SELECT r.id, coalesce(r.ocupat_fins > now(), false) FROM lliuraments l JOIN repartidors r ON r.id = l.repartidor_id
		WHERE l.comanda_id = $1`, id).Scan(&c, &busy); err != nil {
		t.Fatal(err)
	}
	return c, busy
}

// TestCancellationReleasesTheCourierOnce: Vic has one courier; order 1 takes
// it, order 2 waits pending. Cancelling order 1 (twice) frees the courier
// once and the assigner gives it to order 2; cancelling order 2 then frees
// it again; a cancellation before a comanda.pagada leaves a tombstone and
// the payment assigns nothing (no maps call, no event).
func TestCancellationReleasesTheCourierOnce(t *testing.T) {
	t.Parallel()
	var maps atomic.Int32 // calls to maps
	b := setup(t, func(string, int) bool { maps.Add(1); return false }, nil)
	ctx := context.Background()
	run := func(tipus string, dades map[string]any) {
		t.Helper()
		if err := svctest.Run(t, b.pool, b.svc.HandleOrder, svctest.Message(t, "comandes.esdeveniments", tipus, 1, dades)); err != nil {
			t.Fatalf("%s: %v", tipus, err)
		}
	}
	cancel := func(id string) map[string]any { return map[string]any{"comanda_id": id, "motiu": "client"} }
	run("comanda.pagada", paid("P-2026-000001", "Vic"))
	run("comanda.pagada", paid("P-2026-000002", "Vic"))
	if c, busy := courierOf(t, b, "P-2026-000001"); c != "vic-1" || !busy || state(t, b, "P-2026-000002") != repartiment.StatePending {
		t.Fatalf("before: courier %s busy %v, order 2 %s", c, busy, state(t, b, "P-2026-000002"))
	}
	run("comanda.cancellada", cancel("P-2026-000001"))
	run("comanda.cancellada", cancel("P-2026-000001"))
	if _, busy := courierOf(t, b, "P-2026-000001"); busy || state(t, b, "P-2026-000001") != repartiment.StateCancelled {
		t.Fatalf("after cancelling 1: courier busy %v, state %s", busy, state(t, b, "P-2026-000001"))
	}
	if n, err := b.svc.AssignPending(ctx); err != nil || n != 1 {
		t.Fatalf("assigner: %d %v, want 1", n, err)
	}
	if c, busy := courierOf(t, b, "P-2026-000002"); c != "vic-1" || !busy {
		t.Fatalf("order 2: courier %s busy %v", c, busy)
	}
	run("comanda.cancellada", cancel("P-2026-000001")) // a late repeat must not free order 2's courier
	if _, busy := courierOf(t, b, "P-2026-000002"); !busy {
		t.Fatal("a repeated cancellation of order 1 released order 2's courier")
	}
	run("comanda.cancellada", cancel("P-2026-000002"))
	if _, busy := courierOf(t, b, "P-2026-000002"); busy {
		t.Fatal("order 2's cancellation did not release its courier")
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM lliuraments WHERE alliberat`); n != 2 {
		t.Fatalf("%d couriers released, want 2", n)
	}

	calls := maps.Load()
	run("comanda.cancellada", cancel("P-2026-000003"))
	run("comanda.pagada", paid("P-2026-000003", "Girona"))
	if st := state(t, b, "P-2026-000003"); st != repartiment.StateCancelled || maps.Load() != calls {
		t.Fatalf("payment after its cancellation: state %s, maps called %d times", st, maps.Load()-calls)
	}
	if n := events(t, b, "repartiment.assignat"); n != 2 {
		t.Fatalf("%d repartiment.assignat, want 2 (orders 1 and 2)", n)
	}
}
