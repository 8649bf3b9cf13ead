package pagaments_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/outcome"
)

// With RequireApproval the charging consumer charges only an order whose
// approved authorisation covers its total. A comanda.creada of 9,000 EUR with
// no authorisation, with a refused one, or one of 29 EUR authorised for 10,
// is refused for good (permanent, Final: dead-lettered without blocking its
// key) and the gateway is never called; an order authorised for its total
// is charged.
func TestChargeRefusesAnOrderWithoutStoredApproval(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s, err := pagaments.New(pagaments.Config{Pool: b.pool, Outbox: svctest.Outbox(t), RequireApproval: true,
		Gateway: &passarella.Client{BaseURL: b.url, APIKey: b.gw.APIKey(), Timeout: time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	authorize := func(id string, cents int64) {
		body, _ := json.Marshal(pagaments.AuthRequest{OrderID: id, TotalCents: cents})
		if _, err := s.Authorize(ctx, body); err != nil {
			t.Fatal(err)
		}
	}
	order := func(id string, cents int64) error {
		o := map[string]any{"id": id, "linies": []map[string]any{{"quantitat": 1, "preu_centims": cents}}}
		return svctest.Run(t, b.pool, s.HandleOrderCreated, svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 2, o))
	}
	authorize("P-refusada", 900_000)
	authorize("P-petita", 1_000)
	for _, tc := range []struct {
		id    string
		cents int64
		why   string
	}{{"P-sense", 900_000, "none stored"}, {"P-refusada", 900_000, "refused"}, {"P-petita", 2_900, "above the 1000 authorised"}} {
		err := order(tc.id, tc.cents)
		kind, _ := outcome.Classify(err, nil)
		if kind != outcome.KindPermanent || !errors.Is(err, pagaments.ErrNotAuthorised) || !pagaments.Final(err) ||
			!strings.HasPrefix(err.Error(), "sense_autoritzacio: "+tc.id) || !strings.Contains(err.Error(), tc.why) {
			t.Fatalf("order %s: %v (kind %v), want a permanent, final sense_autoritzacio saying %q", tc.id, err, kind, tc.why)
		}
	}
	charges, err := b.gw.Charges(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(charges) != 0 {
		t.Fatalf("the gateway charged %v for orders without approval, want nothing", charges)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM pagaments"); n != 0 {
		t.Fatalf("%d payments recorded, want 0", n)
	}
	authorize("P-aprovada", 2_900)
	if err := order("P-aprovada", 2_900); err != nil {
		t.Fatalf("an order authorised for its total: %v", err)
	}
	if charges, _ = b.gw.Charges(ctx); len(charges) != 1 || charges["cobrament-P-aprovada"].TotalCents != 2_900 {
		t.Fatalf("gateway charges %v, want one of 2900 for P-aprovada", charges)
	}
}
