package inventari

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/tracing"
)

// SQL of HandleOrdersCreated. lockStock locks the rows of a batch's products
// in product order (LockRows sits above the sort, so rows are locked in the
// order they are returned): every transaction of inventari takes its estoc
// rows in one global order. takeStock then writes every product's new stock
// in one statement; CHECK (unitats >= 0) still guards the floor.
const (
	lockStock = `SELECT producte, unitats FROM estoc WHERE producte = ANY($1::text[]) ORDER BY producte FOR UPDATE`
	takeStock = `UPDATE estoc e SET unitats = e.unitats - v.q
		FROM unnest($1::text[], $2::int[]) AS v(producte, q) WHERE e.producte = v.producte`
)

// HandleOrdersCreated is the consumer.BatchOutcomeHandler of comanda.creada
// (consumidor ConsumerDecrement); wire it as consumer.Config.HandleBatchOutcomes.
// In the consumer's transaction, which also holds the messages' idempotency
// keys, it
//
//  1. decodes every order and sums its lines per product;
//  2. locks the estoc rows of all the batch's products at once, in product
//     order (SELECT … ORDER BY producte FOR UPDATE), so concurrent batches
//     never wait for each other's rows in opposite orders and cannot
//     deadlock; a batch waits for another only until that one commits;
//  3. applies the orders in memory in message order: an order is served
//     whole (every line from the stock left by the orders before it) or
//     refused whole, on its own;
//  4. writes the stock of every product served with one UPDATE … FROM
//     unnest, and one estoc.actualitzat per (order, product) with one
//     outbox.EnqueueBatch. Per product the events are in message order and
//     chain: each abans is the previous despres.
//
// The outbox trigger takes a per-product advisory lock for each event; a
// transaction writes product p's events only while it holds p's estoc row
// lock, so no inventari transaction ever waits on those locks (two products
// whose agregat_id hash the same are the exception, and a deadlock between
// them is rerun in place by the consumer).
//
// A refused order's outcome is outcome.Permanent: "esquema: …" for bad data,
// "estoc_insuficient: …" (ErrInsufficient) or "producte_desconegut: …"
// (ErrUnknownProduct); it wrote nothing, and the consumer deletes its key and
// dead-letters it. A database error fails the batch.
func (s *Service) HandleOrdersCreated(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) ([]error, error) {
	outcomes := make([]error, len(msgs))
	orders := make([]order, len(msgs))
	var products []string
	for i, m := range msgs {
		o, err := decodeOrder(m)
		if err != nil {
			outcomes[i] = err
			continue
		}
		orders[i] = o
		for _, l := range o.lines {
			products = append(products, l.Product)
		}
	}
	slices.Sort(products)
	products = slices.Compact(products)
	stock := make(map[string]int, len(products))
	if len(products) > 0 {
		rows, err := tx.Query(ctx, lockStock, products)
		if err != nil {
			return nil, fmt.Errorf("inventari: lock estoc: %w", err)
		}
		var (
			p string
			n int
		)
		if _, err := pgx.ForEachRow(rows, []any{&p, &n}, func() error { stock[p] = n; return nil }); err != nil {
			return nil, fmt.Errorf("inventari: lock estoc: %w", err)
		}
	}
	taken := map[string]int{}
	var events []*outbox.Event
	for i, o := range orders {
		if outcomes[i] != nil {
			continue
		}
		if err := check(stock, o.lines); err != nil {
			outcomes[i] = err
			continue
		}
		for _, l := range o.lines {
			before := stock[l.Product]
			stock[l.Product] = before - l.Quantity
			taken[l.Product] += l.Quantity
			// Headers: each event continues the trace of its own order's
			// message, not the batch's.
			events = append(events, &outbox.Event{Aggregate: Aggregate, AggregateID: l.Product, Type: TypeStockUpdated,
				Payload: StockUpdated{Product: l.Product, Before: before, After: before - l.Quantity, Reason: ReasonOrder, OrderID: o.id},
				Headers: tracing.Headers(msgs[i].Context())})
		}
	}
	if len(taken) > 0 {
		ps, qs := make([]string, 0, len(taken)), make([]int32, 0, len(taken))
		for _, p := range products {
			if q, ok := taken[p]; ok {
				ps, qs = append(ps, p), append(qs, int32(q)) // q <= the stock read, an INTEGER
			}
		}
		tag, err := tx.Exec(ctx, takeStock, ps, qs)
		if err != nil {
			return nil, fmt.Errorf("inventari: take estoc: %w", err)
		}
		if tag.RowsAffected() != int64(len(ps)) {
			return nil, fmt.Errorf("inventari: take estoc: %d rows updated, want %d", tag.RowsAffected(), len(ps))
		}
		if err := s.cfg.Outbox.EnqueueBatch(ctx, tx, events); err != nil {
			return nil, err
		}
	}
	return outcomes, nil
}

// order is a decoded comanda.creada: its id and its lines summed per
// product, in product order.
type order struct {
	id    string
	lines []Line
}

func decodeOrder(m *consumer.Message) (order, error) {
	var o orderCreated
	if err := strictjson.Unmarshal(m.Envelope.Data, &o); err != nil {
		return order{}, outcome.Permanentf("esquema: comanda.creada: %v", err)
	}
	if o.ID == "" || len(o.Lines) == 0 {
		return order{}, outcome.Permanentf("esquema: comanda.creada sense id o sense linies")
	}
	lines, err := sumLines(o.Lines)
	if err != nil {
		return order{}, err
	}
	return order{id: o.ID, lines: lines}, nil
}

// sumLines checks lines and sums them per product, in product order. A
// product left empty or that PostgreSQL cannot store as text (NUL, invalid
// UTF-8), a quantity that is not positive, or a sum past what an INTEGER
// column holds (a sum that wrapped negative would add stock) is a permanent
// "esquema" error.
func sumLines(lines []Line) ([]Line, error) {
	perProduct := make(map[string]int, len(lines))
	for i, l := range lines {
		if l.Product == "" || l.Quantity <= 0 {
			return nil, outcome.Permanentf("esquema: linies[%d]: producte buit o quantitat %d", i, l.Quantity)
		}
		if strings.ContainsRune(l.Product, 0) || !utf8.ValidString(l.Product) {
			return nil, outcome.Permanentf("esquema: linies[%d]: producte amb un caràcter nul o UTF-8 no vàlid", i)
		}
		if l.Quantity > math.MaxInt32 || perProduct[l.Product] > math.MaxInt32-l.Quantity {
			return nil, outcome.Permanentf("esquema: linies[%d]: quantitat de %s massa gran", i, l.Product)
		}
		perProduct[l.Product] += l.Quantity
	}
	out := make([]Line, 0, len(perProduct))
	for p, q := range perProduct {
		out = append(out, Line{Product: p, Quantity: q})
	}
	slices.SortFunc(out, func(a, b Line) int { return strings.Compare(a.Product, b.Product) })
	return out, nil
}

// check reports whether stock can serve every line: nil, or the permanent
// error of the first product (in product order) that is unknown or short.
func check(stock map[string]int, lines []Line) error {
	for _, l := range lines {
		have, ok := stock[l.Product]
		if !ok {
			return outcome.Permanent(fmt.Errorf("%w: %s", ErrUnknownProduct, l.Product))
		}
		if have < l.Quantity {
			return outcome.Permanent(fmt.Errorf("%w: %s (en queden %d, se'n demanen %d)", ErrInsufficient, l.Product, have, l.Quantity))
		}
	}
	return nil
}
