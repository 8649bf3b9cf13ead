package analitica_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"testing"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/transport"
)

func TestCountsPerTipusAndMercat(t *testing.T) {
	t.Parallel()
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
	t.Parallel()
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
	t.Parallel()
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

// TestAnyOtherMotiuCountsAsAltres: 300 distinct free-text motius (bidi
// characters, 200 bytes, an operator's note) make one row, altres = 300,
// beside the known client, the inventari refusals and ciutat_no_coberta.
func TestAnyOtherMotiuCountsAsAltres(t *testing.T) {
	t.Parallel()
	pool, _ := svctest.DB(t, analitica.Migrations)
	s, _ := analitica.New(pool)
	motius := []string{comandes.ReasonClient, inventari.ErrInsufficient.Error(), inventari.ErrUnknownProduct.Error(), comandes.ReasonNotCovered}
	for i := range 300 {
		motius = append(motius, fmt.Sprintf("nota %d \u202etxet", i))
	}
	motius[11] = strings.Repeat("x", 200)
	for _, motiu := range motius {
		m := svctest.Message(t, "t", "comanda.cancellada", 1, map[string]any{"comanda_id": "P-2026-000001", "motiu": motiu})
		if err := svctest.Run(t, pool, s.HandleEvent, m); err != nil {
			t.Fatal(err)
		}
	}
	c, err := s.Counters(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"client": 1, "estoc_insuficient": 1, "producte_desconegut": 1, "ciutat_no_coberta": 1, analitica.ReasonOther: 300}
	if !maps.Equal(c.PerCancelReason, want) || c.PerType["comanda.cancellada"] != 304 {
		t.Fatalf("%d motiu rows (altres %d, client %d), %d comanda.cancellada; want %v and 304",
			len(c.PerCancelReason), c.PerCancelReason[analitica.ReasonOther], c.PerCancelReason["client"], c.PerType["comanda.cancellada"], want)
	}
	if len(analitica.KnownCancelReasons) != 4 {
		t.Fatalf("known motius %v: this test counts 4", analitica.KnownCancelReasons)
	}
}

// TestACopyOfACountedEventIsNotCountedAgain: comanda.cancellada delivered
// first, then republished by the relay (the same envelope again), then
// replayed from the DLQ (the same envelope on the .dlq topic): counted once
// (1 per tipus, 1 per motiu). Another event of the same content but another
// id counts (2).
func TestACopyOfACountedEventIsNotCountedAgain(t *testing.T) {
	t.Parallel()
	pool, _ := svctest.DB(t, analitica.Migrations)
	s, _ := analitica.New(pool)
	m := svctest.Message(t, "comandes.esdeveniments", "comanda.cancellada", 1, map[string]any{"comanda_id": "P-2026-000001", "motiu": "client"})
	republished := *m.Message
	replayed := *m.Message
	replayed.Topic = "comandes.esdeveniments.dlq"
	for _, tm := range []*transport.Message{m.Message, &republished, &replayed} {
		if err := svctest.Run(t, pool, s.HandleEvent, &consumer.Message{Message: tm, Envelope: m.Envelope}); err != nil {
			t.Fatal(err)
		}
	}
	c, err := s.Counters(context.Background())
	if err != nil || c.PerType["comanda.cancellada"] != 1 || c.PerCancelReason["client"] != 1 {
		t.Fatalf("after three copies: %+v %v, want 1 and 1", c, err)
	}
	other := svctest.Message(t, "comandes.esdeveniments", "comanda.cancellada", 1, map[string]any{"comanda_id": "P-2026-000001", "motiu": "client"})
	if err := svctest.Run(t, pool, s.HandleEvent, other); err != nil {
		t.Fatal(err)
	}
	c, err = s.Counters(context.Background())
	if err != nil || c.PerType["comanda.cancellada"] != 2 || c.PerCancelReason["client"] != 2 {
		t.Fatalf("after another event: %+v %v, want 2 and 2", c, err)
	}
}

// TestACopyCountsWhenTheFirstCountRolledBack: the consumer reruns a batch
// that failed, so an event whose handler succeeded in a transaction that
// then rolled back comes again and must count (1); an event and its copy in
// one batch transaction count once (1), and a copy after that batch
// committed does not count (still 1).
func TestACopyCountsWhenTheFirstCountRolledBack(t *testing.T) {
	t.Parallel()
	pool, _ := svctest.DB(t, analitica.Migrations)
	s, _ := analitica.New(pool)
	ctx := context.Background()
	a := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 1, map[string]any{"id": "P-2026-000001", "mercat": "girona"})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.HandleEvent(ctx, tx, a); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil { // another message of the batch failed
		t.Fatal(err)
	}
	if err := svctest.Run(t, pool, s.HandleEvent, a); err != nil { // the rerun
		t.Fatal(err)
	}
	b := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 1, map[string]any{"id": "P-2026-000002", "mercat": "vic"})
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 { // b and its republication in one batch
		if err := s.HandleEvent(ctx, tx, b); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, m := range []*consumer.Message{a, b} {
		if err := svctest.Run(t, pool, s.HandleEvent, m); err != nil {
			t.Fatal(err)
		}
	}
	c, err := s.Counters(ctx)
	if err != nil || c.PerType["comanda.creada"] != 2 || c.PerMarket["girona"] != 1 || c.PerMarket["vic"] != 1 {
		t.Fatalf("counters %+v %v: want 2 comanda.creada, girona 1, vic 1", c, err)
	}
}
