package inventari_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/outcome"
)

// Bodies that encoding/json alone reads differently from other decoders (the
// last of two members, a member named like a field but for case, invalid
// UTF-8) are refused as permanent "esquema" errors and take no stock: by
// ReservarEstoc, by the single handler and by the batch handler.
func TestAmbiguousBodiesAreRefusedAndTakeNoStock(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	bodies := []string{
		`{"id_reserva":"R-1","linies":[{"producte":"carbasso","quantitat":1,"quantitat":70}]}`,
		`{"id_reserva":"R-2","linies":[{"producte":"carbasso","Quantitat":70,"quantitat":1}]}`,
		"{\"id_reserva\":\"R-3\",\"linies\":[{\"producte\":\"carbasso\xff\",\"quantitat\":1}]}",
	}
	for _, b := range bodies {
		if _, err := s.Reserve(ctx, []byte(b)); !outcome.IsPermanent(err) || !strings.Contains(err.Error(), "esquema") {
			t.Errorf("Reserve %s: got %v, want a permanent esquema error", b, err)
		}
	}
	dades := []string{
		`{"id":"P-2026-000001","linies":[{"producte":"carbasso","quantitat":1,"quantitat":70}]}`,
		`{"id":"P-2026-000001","linies":[{"producte":"carbasso","quantitat":1}],"linies":[{"producte":"carbasso","quantitat":70}]}`,
		`{"id":"P-2026-000001","linies":[{"producte":"carbasso","PRODUCTE":"vi-crianca","quantitat":1}]}`,
	}
	var msgs []*consumer.Message
	for _, d := range dades {
		m := svctest.Message(t, "comandes.esdeveniments", inventari.TypeOrderCreated, 2, json.RawMessage(d))
		msgs = append(msgs, m)
		if err := svctest.Run(t, pool, s.HandleOrderCreated, m); !outcome.IsPermanent(err) || !strings.Contains(err.Error(), "esquema") {
			t.Errorf("HandleOrderCreated %s: got %v, want a permanent esquema error", d, err)
		}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		outcomes, err := s.HandleOrdersCreated(ctx, tx, msgs)
		for i, o := range outcomes {
			if !outcome.IsPermanent(o) || !strings.Contains(o.Error(), "esquema") {
				t.Errorf("HandleOrdersCreated %s: got %v, want a permanent esquema error", dades[i], o)
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := units(t, pool, "carbasso"); got != 80 {
		t.Fatalf("carbasso %d, want the seeded 80", got)
	}
}
