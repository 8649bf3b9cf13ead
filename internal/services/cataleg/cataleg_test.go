package cataleg_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/outcome"
)

func TestFlagIsIdempotentByNature(t *testing.T) {
	t.Parallel()
	pool, _ := svctest.DB(t, cataleg.Migrations)
	s, _ := cataleg.New(pool)
	low := svctest.Message(t, "inventari.esdeveniments", "estoc.actualitzat", 1, map[string]any{"producte": "formatge-curat", "abans": 5, "despres": 3})
	ok := svctest.Message(t, "inventari.esdeveniments", "estoc.actualitzat", 1, map[string]any{"producte": "carbasso", "abans": 80, "despres": 79})
	for range 2 { // the relay republished everything: same state
		if err := svctest.Run(t, pool, s.HandleStockUpdated, low); err != nil {
			t.Fatal(err)
		}
		if err := svctest.Run(t, pool, s.HandleStockUpdated, ok); err != nil {
			t.Fatal(err)
		}
	}
	f, err := s.Flags(context.Background())
	if err != nil || len(f) != 2 || f[0] != (cataleg.Flag{Product: "carbasso", Units: 79}) || f[1] != (cataleg.Flag{Product: "formatge-curat", LowStock: true, Units: 3}) {
		t.Fatalf("flags %+v %v", f, err)
	}
	if n := svctest.Count(t, pool, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'missatges_processats'"); n != 0 {
		t.Fatal("cataleg must not need an inbox table")
	}
	for what, dades := range map[string]map[string]any{
		"no despres":        {"producte": "x"},
		"despres over int4": {"producte": "x", "despres": int64(1) << 31},
		"negative despres":  {"producte": "x", "despres": -1},
		"despres a string":  {"producte": "x", "despres": "3"},
		"NUL in producte":   {"producte": "x\x00y", "despres": 3},
	} {
		bad := svctest.Message(t, "inventari.esdeveniments", "estoc.actualitzat", 1, dades)
		if err := svctest.Run(t, pool, s.HandleStockUpdated, bad); !outcome.IsPermanent(err) {
			t.Errorf("%s: %v, want a permanent (esquema) failure", what, err)
		}
	}
}

// An estoc.actualitzat with a repeated despres, or one named "Despres", is
// read differently by other decoders: permanent, and no flag is written.
func TestAmbiguousStockUpdateIsPermanent(t *testing.T) {
	t.Parallel()
	pool, _ := svctest.DB(t, cataleg.Migrations)
	s, _ := cataleg.New(pool)
	for _, d := range []string{`{"producte":"carbasso","despres":3,"despres":50}`, `{"producte":"carbasso","Despres":3,"despres":50}`} {
		m := svctest.Message(t, "inventari.esdeveniments", "estoc.actualitzat", 1, json.RawMessage(d))
		if err := svctest.Run(t, pool, s.HandleStockUpdated, m); !outcome.IsPermanent(err) {
			t.Errorf("%s: got %v, want permanent", d, err)
		}
	}
	if n := svctest.Count(t, pool, "SELECT count(*) FROM indicadors"); n != 0 {
		t.Fatalf("%d flags written", n)
	}
}

// TestStockGivenBackByACancellationClearsTheFlag: cataleg follows a
// cancellation through inventari's estoc.actualitzat (motiu cancellacio):
// 3 units (low) back to 5 (not low).
func TestStockGivenBackByACancellationClearsTheFlag(t *testing.T) {
	t.Parallel()
	pool, _ := svctest.DB(t, cataleg.Migrations)
	s, _ := cataleg.New(pool)
	for _, d := range []map[string]any{
		{"producte": "formatge-curat", "abans": 5, "despres": 3, "motiu": "comanda", "comanda_id": "P-2026-000001"},
		{"producte": "formatge-curat", "abans": 3, "despres": 5, "motiu": "cancellacio", "comanda_id": "P-2026-000001"},
	} {
		if err := svctest.Run(t, pool, s.HandleStockUpdated, svctest.Message(t, "inventari.esdeveniments", "estoc.actualitzat", 1, d)); err != nil {
			t.Fatal(err)
		}
	}
	f, err := s.Flags(context.Background())
	if err != nil || len(f) != 1 || f[0] != (cataleg.Flag{Product: "formatge-curat", Units: 5}) {
		t.Fatalf("flags %+v %v, want formatge-curat 5 not low", f, err)
	}
}
