package analitica_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/km0/km0/services/analitica"
	"github.com/km0/km0/services/internal/svctest"
)

func TestCountsPerTipusAndMercat(t *testing.T) {
	pool, _ := svctest.DB(t, analitica.Migrations)
	s, _ := analitica.New(pool)
	msgs := []struct {
		tipus string
		dades map[string]any
	}{
		{"comanda.creada", map[string]any{"id": "P-2026-000001", "mercat": "girona"}},
		{"comanda.creada", map[string]any{"id": "P-2026-000002", "mercat": "vic"}},
		{"comanda.creada", map[string]any{"id": "P-2026-000003", "mercat": "girona"}},
		{"estoc.actualitzat", map[string]any{"producte": "carbasso", "mercat": "ignored"}},
		{"comanda.creada", map[string]any{"id": "P-2026-000004"}},
	}
	for _, m := range msgs {
		if err := svctest.Run(t, pool, s.HandleEvent, svctest.Message(t, "t", m.tipus, 1, m.dades)); err != nil {
			t.Fatal(err)
		}
	}
	c, err := s.Counters(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if c.PerType["comanda.creada"] != 4 || c.PerType["estoc.actualitzat"] != 1 || c.PerMarket["girona"] != 2 || c.PerMarket["vic"] != 1 || len(c.PerMarket) != 2 {
		t.Fatalf("counters %+v", c)
	}
}

// A comanda.creada whose mercat another decoder reads differently (given
// twice, or as "Mercat") counts under its tipus only, never under a market.
func TestAmbiguousMarketIsNotCounted(t *testing.T) {
	pool, _ := svctest.DB(t, analitica.Migrations)
	s, _ := analitica.New(pool)
	for _, d := range []string{`{"id":"P-2026-000001","mercat":"girona","mercat":"vic"}`, `{"id":"P-2026-000002","Mercat":"vic","mercat":"girona"}`} {
		if err := svctest.Run(t, pool, s.HandleEvent, svctest.Message(t, "t", "comanda.creada", 1, json.RawMessage(d))); err != nil {
			t.Fatal(err)
		}
	}
	c, err := s.Counters(context.Background())
	if err != nil || c.PerType["comanda.creada"] != 2 || len(c.PerMarket) != 0 {
		t.Fatalf("counters %+v %v: want 2 comanda.creada and no market", c, err)
	}
}

// TestCountsCancellationsPerMotiu: 2 client, 1 estoc_insuficient; one
// without motiu counts under its tipus only.
func TestCountsCancellationsPerMotiu(t *testing.T) {
	pool, _ := svctest.DB(t, analitica.Migrations)
	s, _ := analitica.New(pool)
	for _, motiu := range []string{"client", "estoc_insuficient", "client", ""} {
		if err := svctest.Run(t, pool, s.HandleEvent, svctest.Message(t, "t", "comanda.cancellada", 1, map[string]any{"comanda_id": "P-2026-000001", "motiu": motiu})); err != nil {
			t.Fatal(err)
		}
	}
	c, err := s.Counters(context.Background())
	if err != nil || c.PerType["comanda.cancellada"] != 4 || c.PerCancelReason["client"] != 2 || c.PerCancelReason["estoc_insuficient"] != 1 || len(c.PerCancelReason) != 2 {
		t.Fatalf("counters %+v %v", c, err)
	}
}
