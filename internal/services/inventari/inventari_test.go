package inventari_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

func setup(t *testing.T) (*pgxpool.Pool, *inventari.Service) {
	t.Helper()
	pool, _ := svctest.DB(t, migrate.Outbox, migrate.Inbox, inventari.Migrations)
	s, err := inventari.New(inventari.Config{Pool: pool, Outbox: svctest.Outbox(t)})
	if err != nil {
		t.Fatal(err)
	}
	return pool, s
}

func order(id string, lines ...inventari.Line) map[string]any {
	return map[string]any{"id": id, "client": "anna", "mercat": "girona", "linies": lines}
}

func units(t *testing.T, pool *pgxpool.Pool, p string) int {
	return svctest.Count(t, pool, "SELECT unitats FROM estoc WHERE producte = $1", p)
}

func TestOrderCreatedTakesStockAndWritesEstocActualitzatPerProduct(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	m := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 2, order("P-2026-000001",
		inventari.Line{Product: "tomaquet-rosa", Quantity: 3}, inventari.Line{Product: "formatge-curat", Quantity: 2},
		inventari.Line{Product: "tomaquet-rosa", Quantity: 1}))
	// The consumer runs the handler inside inbox.ProcessTx; the redelivery after
	// "dies between COMMIT and the offset commit" is a duplicate and changes nothing.
	ib := inbox.New(inbox.Config{})
	for i, want := range []inbox.Result{inbox.Processed, inbox.Duplicate} {
		res, err := ib.Process(context.Background(), pool, inventari.ConsumerDecrement, m.Envelope.ID, func(tx pgx.Tx) error {
			return s.HandleOrderCreated(context.Background(), tx, m)
		})
		if err != nil || res != want {
			t.Fatalf("delivery %d: %v %v", i, res, err)
		}
	}
	if got := units(t, pool, "tomaquet-rosa"); got != 116 {
		t.Fatalf("tomaquet-rosa %d, want 116", got)
	}
	if got := units(t, pool, "formatge-curat"); got != 3 {
		t.Fatalf("formatge-curat %d, want 3", got)
	}
	rows, err := pool.Query(context.Background(), `SELECT agregat, agregat_id, carrega FROM outbox WHERE tipus = 'estoc.actualitzat' ORDER BY agregat_id`)
	if err != nil {
		t.Fatal(err)
	}
	var got []inventari.StockUpdated
	for rows.Next() {
		var agg, aggID string
		var body []byte
		if err := rows.Scan(&agg, &aggID, &body); err != nil {
			t.Fatal(err)
		}
		var e inventari.StockUpdated
		_ = json.Unmarshal(body, &e)
		if agg != "producte" || aggID != e.Product {
			t.Fatalf("agregat %s/%s for %+v", agg, aggID, e)
		}
		got = append(got, e)
	}
	want := []inventari.StockUpdated{
		{Product: "formatge-curat", Before: 5, After: 3, Reason: "comanda", OrderID: "P-2026-000001"},
		{Product: "tomaquet-rosa", Before: 120, After: 116, Reason: "comanda", OrderID: "P-2026-000001"},
	}
	if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("events %+v, want %+v", got, want)
	}
}

func TestInsufficientOrUnknownIsPermanentAndChangesNothing(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	cases := []struct {
		lines []inventari.Line
		want  error
	}{
		// carbasso sorts first and is taken before formatge-curat fails: it must roll back.
		{[]inventari.Line{{Product: "formatge-curat", Quantity: 6}, {Product: "carbasso", Quantity: 1}}, inventari.ErrInsufficient},
		{[]inventari.Line{{Product: "caviar", Quantity: 1}}, inventari.ErrUnknownProduct},
		{[]inventari.Line{{Product: "carbasso", Quantity: 0}}, nil},
		{[]inventari.Line{{Product: "carbas\x00so", Quantity: 1}}, nil}, // text PostgreSQL refuses: bad data, not a retry
	}
	for i, c := range cases {
		m := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 1, order("P-2026-000002", c.lines...))
		err := svctest.Run(t, pool, s.HandleOrderCreated, m)
		if !outcome.IsPermanent(err) || (c.want != nil && !errors.Is(err, c.want)) {
			t.Fatalf("case %d: %v, want permanent %v", i, err, c.want)
		}
	}
	if got := units(t, pool, "carbasso"); got != 80 {
		t.Fatalf("carbasso %d, want 80 (rolled back)", got)
	}
	if n := svctest.Count(t, pool, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("%d events written by failed orders", n)
	}
}

// Quantities past what an INTEGER column holds are bad data, not a transient
// failure, and two lines whose sum overflows must not add stock.
func TestHugeQuantitiesArePermanentAndNeverAddStock(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	const maxInt = int(^uint(0) >> 1)
	for i, lines := range [][]inventari.Line{
		{{Product: "carbasso", Quantity: maxInt}, {Product: "carbasso", Quantity: maxInt}}, // sum wraps to -2
		{{Product: "carbasso", Quantity: 3_000_000_000}},                                   // over int4
	} {
		m := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 1, order("P-2026-000009", lines...))
		if err := svctest.Run(t, pool, s.HandleOrderCreated, m); !outcome.IsPermanent(err) {
			t.Errorf("order case %d: %v, want permanent", i, err)
		}
		body, _ := json.Marshal(inventari.ReserveRequest{ID: fmt.Sprintf("R-huge-%d", i), Lines: lines})
		out, err := s.Reserve(ctx, body)
		var r inventari.ReserveResponse
		if err == nil && (json.Unmarshal(out, &r) != nil || r.Accepted) {
			t.Errorf("reserve case %d accepted: %s", i, out)
		}
	}
	if got := units(t, pool, "carbasso"); got != 80 {
		t.Fatalf("carbasso %d, want 80", got)
	}
	if n := svctest.Count(t, pool, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("%d events written", n)
	}
}

func TestConcurrentOrdersNeverTakeStockBelowZero(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	var wg sync.WaitGroup
	var mu sync.Mutex
	ok, insufficient := 0, 0
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Opposite line orders in half of the orders: sorted locking avoids deadlocks.
			lines := []inventari.Line{{Product: "formatge-curat", Quantity: 1}, {Product: "carbasso", Quantity: 1}}
			if i%2 == 1 {
				lines[0], lines[1] = lines[1], lines[0]
			}
			err := svctest.Run(t, pool, s.HandleOrderCreated, svctest.Message(t, "c", "comanda.creada", 1, order(fmt.Sprintf("P-2026-%06d", 100+i), lines...)))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				ok++
			case errors.Is(err, inventari.ErrInsufficient):
				insufficient++
			default:
				t.Errorf("order %d: %v", i, err)
			}
		}()
	}
	wg.Wait()
	if ok != 5 || insufficient != 7 || units(t, pool, "formatge-curat") != 0 || units(t, pool, "carbasso") != 75 {
		t.Fatalf("ok %d insufficient %d formatge-curat %d carbasso %d", ok, insufficient, units(t, pool, "formatge-curat"), units(t, pool, "carbasso"))
	}
}

func TestReserveIsIdempotentByIdReserva(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	req := []byte(`{"id_reserva":"R-1","linies":[{"producte":"vi-crianca","quantitat":10}]}`)
	first, err := s.Reserve(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	again, err := s.Reserve(ctx, req)
	if err != nil || !bytes.Equal(first, again) {
		t.Fatalf("repeat: %s %v, want %s", again, err, first)
	}
	if got := units(t, pool, "vi-crianca"); got != 190 {
		t.Fatalf("vi-crianca %d, want 190", got)
	}
	refused, err := s.Reserve(ctx, []byte(`{"id_reserva":"R-2","linies":[{"producte":"vi-crianca","quantitat":5},{"producte":"formatge-curat","quantitat":50}]}`))
	var r inventari.ReserveResponse
	if err != nil || json.Unmarshal(refused, &r) != nil || r.Accepted || !strings.Contains(r.Reason, "estoc_insuficient") {
		t.Fatalf("refused: %s %v", refused, err)
	}
	if got := units(t, pool, "vi-crianca"); got != 190 {
		t.Fatalf("a refused reservation took stock: vi-crianca %d", got)
	}
	if n := svctest.Count(t, pool, "SELECT count(*) FROM missatges_processats WHERE consumidor = 'inventari.reserva'"); n != 2 {
		t.Fatalf("keys %d, want 2", n)
	}
	if n := svctest.Count(t, pool, "SELECT count(*) FROM outbox WHERE carrega->>'motiu' = 'reserva'"); n != 1 {
		t.Fatalf("reserve events %d, want 1", n)
	}
	if _, err := s.Reserve(ctx, []byte(`{"linies":"x"}`)); !outcome.IsPermanent(err) {
		t.Fatalf("malformed: %v", err)
	}
}

// An id_reserva PostgreSQL would refuse as a key (NUL, invalid UTF-8, over
// 8 KB) is a permanent error reply that names the field and quotes nothing of
// PostgreSQL, and it takes no stock.
func TestReserveRefusesBadIDsPermanentlyWithoutDatabaseText(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	raw := make([]byte, 4500)
	_, _ = rand.Read(raw)
	log := slog.New(slog.DiscardHandler)
	for _, id := range []string{`R-\u0000-1`, `R-\u001b`, hex.EncodeToString(raw)} {
		body := []byte(`{"id_reserva":"` + id + `","linies":[{"producte":"vi-crianca","quantitat":1}]}`)
		out, isErr := requestreply.Serve(ctx, log, func(ctx context.Context, r *requestreply.Request) ([]byte, error) {
			return s.Reserve(ctx, r.Body)
		}, &requestreply.Request{ID: "x", Body: body})
		_, err := requestreply.DecodeReply(inventari.ReserveQueue, requestreply.ResultError, out)
		var re *requestreply.RemoteError
		if !isErr || !errors.As(err, &re) || re.Retryable || !strings.Contains(re.Message, "id_reserva") || strings.Contains(re.Message, "SQLSTATE") {
			t.Errorf("id %.20q: got %s; want a permanent refusal naming id_reserva", id, out)
		}
	}
	if got := units(t, pool, "vi-crianca"); got != 200 {
		t.Fatalf("vi-crianca %d, want 200", got)
	}
}
