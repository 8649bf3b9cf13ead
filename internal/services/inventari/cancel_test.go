package inventari_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/outcome"
)

// batch runs msgs through HandleOrdersCreated in one transaction and commits
// it, as the consumer does with HandleBatchOutcomes (a refused message's
// writes commit with the rest; the consumer only deletes its key).
func batch(t *testing.T, pool *pgxpool.Pool, s *inventari.Service, msgs ...*consumer.Message) []error {
	t.Helper()
	var out []error
	if err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		var err error
		out, err = s.HandleOrdersCreated(context.Background(), tx, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func created(t *testing.T, id string, lines ...inventari.Line) *consumer.Message {
	return svctest.Message(t, "comandes.esdeveniments", inventari.TypeOrderCreated, 2, order(id, lines...))
}

func cancelled(t *testing.T, id string) *consumer.Message {
	return svctest.Message(t, "comandes.esdeveniments", inventari.TypeOrderCancelled, 1, map[string]any{"comanda_id": id, "motiu": "client"})
}

// TestCancellationGivesBackExactlyWhatItsOrderTook: A takes 2 formatge-curat
// and 3 carbasso, then is cancelled twice: the stock is back to 5 and 80,
// given back once. B is refused for stock (estoc.refusat once, even when
// replayed) and its cancellation gives back nothing. C is cancelled before
// its creation: the creation takes nothing. D is created and cancelled in
// one batch: net zero, and the events chain.
func TestCancellationGivesBackExactlyWhatItsOrderTook(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	cheese, pumpkin := inventari.Line{Product: "formatge-curat", Quantity: 2}, inventari.Line{Product: "carbasso", Quantity: 3}
	if out := batch(t, pool, s, created(t, "P-2026-000001", cheese, pumpkin)); out[0] != nil {
		t.Fatal(out[0])
	}
	if units(t, pool, "formatge-curat") != 3 || units(t, pool, "carbasso") != 77 {
		t.Fatalf("after A: %d, %d", units(t, pool, "formatge-curat"), units(t, pool, "carbasso"))
	}
	for range 2 {
		if out := batch(t, pool, s, cancelled(t, "P-2026-000001")); out[0] != nil {
			t.Fatal(out[0])
		}
	}
	if units(t, pool, "formatge-curat") != 5 || units(t, pool, "carbasso") != 80 {
		t.Fatalf("after A's cancellations: %d, %d, want 5, 80", units(t, pool, "formatge-curat"), units(t, pool, "carbasso"))
	}
	if n := svctest.Count(t, pool, `SELECT count(*) FROM outbox WHERE tipus = 'estoc.actualitzat' AND carrega->>'motiu' = 'cancellacio'`); n != 2 {
		t.Fatalf("%d give-back events, want 2 (one per product, once)", n)
	}

	for range 2 { // B, and its replay from the DLQ
		out := batch(t, pool, s, created(t, "P-2026-000002", inventari.Line{Product: "formatge-curat", Quantity: 9}))
		if !outcome.IsPermanent(out[0]) || !errors.Is(out[0], inventari.ErrInsufficient) {
			t.Fatalf("B: %v, want a permanent estoc_insuficient", out[0])
		}
	}
	if n := svctest.Count(t, pool, `SELECT count(*) FROM outbox WHERE tipus = 'estoc.refusat' AND agregat_id = 'P-2026-000002' AND carrega->>'motiu' = 'estoc_insuficient'`); n != 1 {
		t.Fatalf("%d estoc.refusat for B, want 1", n)
	}
	if out := batch(t, pool, s, cancelled(t, "P-2026-000002")); out[0] != nil {
		t.Fatal(out[0])
	}
	if st, held, _ := s.OrderState(context.Background(), "P-2026-000002"); st != "cancellada" || len(held) != 0 || units(t, pool, "formatge-curat") != 5 {
		t.Fatalf("B cancelled: %s %v, formatge-curat %d; want cancellada, nothing held, 5", st, held, units(t, pool, "formatge-curat"))
	}

	if out := batch(t, pool, s, cancelled(t, "P-2026-000003")); out[0] != nil { // C: the cancellation overtook the creation
		t.Fatal(out[0])
	}
	if out := batch(t, pool, s, created(t, "P-2026-000003", cheese)); out[0] != nil {
		t.Fatalf("C's creation after its cancellation: %v, want nil (takes nothing)", out[0])
	}
	if units(t, pool, "formatge-curat") != 5 {
		t.Fatalf("C took stock after its cancellation: formatge-curat %d", units(t, pool, "formatge-curat"))
	}

	out := batch(t, pool, s, created(t, "P-2026-000004", cheese), cancelled(t, "P-2026-000004"), created(t, "P-2026-000005", cheese))
	if out[0] != nil || out[1] != nil || out[2] != nil {
		t.Fatalf("D: %v", out)
	}
	if units(t, pool, "formatge-curat") != 3 { // D took 2 and gave them back, E took 2
		t.Fatalf("after D and E: formatge-curat %d, want 3", units(t, pool, "formatge-curat"))
	}
	rows, _ := pool.Query(context.Background(), `SELECT (carrega->>'abans')::int, (carrega->>'despres')::int FROM outbox
		WHERE tipus = 'estoc.actualitzat' AND agregat_id = 'formatge-curat' ORDER BY creat_en, id`)
	var chain [][2]int
	var a, d int
	_, _ = pgx.ForEachRow(rows, []any{&a, &d}, func() error { chain = append(chain, [2]int{a, d}); return nil })
	for i := 1; i < len(chain); i++ {
		if chain[i][0] != chain[i-1][1] {
			t.Fatalf("formatge-curat events do not chain: %v", chain)
		}
	}
	if len(chain) != 5 || chain[len(chain)-1][1] != 3 {
		t.Fatalf("formatge-curat events %v, want 5 ending at 3", chain)
	}
}
