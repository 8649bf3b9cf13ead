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
	"github.com/km0/km0/requestreply"
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
// and comanda.cancellada (consumidor ConsumerDecrement); wire it as
// consumer.Config.HandleBatchOutcomes. In the consumer's transaction, which
// also holds the messages' idempotency keys, it
//
//  1. decodes every order and sums its lines per product;
//  2. takes the batch's orders' advisory locks in comanda_id order (an
//     order's row of comandes_estoc, what inventari did for it, may not
//     exist yet) and reads their rows;
//  3. locks the estoc rows of all the batch's products at once (those the
//     orders ask for and those the cancellations give back), in product
//     order (SELECT … ORDER BY producte FOR UPDATE), so concurrent batches
//     never wait for each other's rows in opposite orders and cannot
//     deadlock; a batch waits for another only until that one commits;
//  4. applies the messages in memory in message order: an order is served
//     whole (every line from the stock left by the messages before it) or
//     refused whole, on its own; a cancellation gives back exactly what its
//     order took (nothing if it was refused), and one that comes before its
//     order leaves a tombstone: the order then takes nothing;
//  5. writes the stock of every product changed with one UPDATE … FROM
//     unnest, the orders' rows with one more, one estoc.actualitzat per
//     (message, product) and one estoc.refusat per refused order with one
//     outbox.EnqueueBatch. Per product the events are in message order and
//     chain: each abans is the previous despres.
//
// The outbox trigger takes a per-aggregate advisory lock for each event; a
// transaction writes product p's events only while it holds p's estoc row
// lock (and an order's refusal only while it holds the order's lock), so no
// inventari transaction ever waits on those locks (two aggregates whose
// agregat_id hash the same are the exception, and a deadlock between them is
// rerun in place by the consumer).
//
// A refused order's outcome is outcome.Permanent: "esquema: …" for bad data,
// "estoc_insuficient: …" (ErrInsufficient) or "producte_desconegut: …"
// (ErrUnknownProduct). Bad data writes nothing; a stock refusal writes only
// the order's row (refusada) and estoc.refusat, the compensation's first step
// (comandes cancels the order, pagaments refunds it); the consumer deletes
// the message's key and dead-letters it. A refused order replayed from the
// DLQ is refused again with its first motiu and publishes nothing more. A
// database error fails the batch.
func (s *Service) HandleOrdersCreated(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) ([]error, error) {
	outcomes := make([]error, len(msgs))
	orders := make([]order, len(msgs))
	var ids, products []string
	for i, m := range msgs {
		var (
			o   order
			err error
		)
		if m.Envelope.Type == TypeOrderCancelled {
			o, err = decodeCancel(m)
		} else {
			o, err = decodeOrder(m)
		}
		if err != nil {
			outcomes[i] = err
			continue
		}
		orders[i] = o
		ids = append(ids, o.id)
		for _, l := range o.lines {
			products = append(products, l.Product)
		}
	}
	recs, err := lockOrders(ctx, tx, ids)
	if err != nil {
		return nil, err
	}
	for _, r := range recs {
		for _, l := range r.lines {
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
	taken := map[string]int{} // net units taken per product (negative: given back)
	var events []*outbox.Event
	// Each event continues the trace of its own message, not the batch's.
	change := func(i int, o order, l Line, delta int, reason string) {
		before := stock[l.Product]
		stock[l.Product] = before - delta
		taken[l.Product] += delta
		events = append(events, &outbox.Event{Aggregate: Aggregate, AggregateID: l.Product, Type: TypeStockUpdated,
			Payload: StockUpdated{Product: l.Product, Before: before, After: before - delta, Reason: reason, OrderID: o.id},
			Headers: tracing.Headers(msgs[i].Context())})
	}
	for i, o := range orders {
		if outcomes[i] != nil {
			continue
		}
		r := recs[o.id]
		if o.cancel {
			switch r.state {
			case stateServed:
				for _, l := range r.lines {
					change(i, o, l, -l.Quantity, ReasonCancel)
				}
				r.state, r.restored, r.dirty = stateCancelled, true, true
			case statePending, stateRefused:
				r.state, r.dirty = stateCancelled, true // a tombstone, or a refused order: nothing to give back
			}
			continue
		}
		switch r.state {
		case stateCancelled, stateServed:
			continue // cancelled first: take nothing; served already (another event of the order): nothing more
		case stateRefused:
			outcomes[i] = refusedAgain(r.reason)
			continue
		}
		if err := check(stock, o.lines); err != nil {
			outcomes[i] = err
			r.state, r.reason, r.dirty = stateRefused, clip(err.Error()), true
			reason, detail, _ := strings.Cut(r.reason, ": ")
			events = append(events, &outbox.Event{Aggregate: AggregateOrder, AggregateID: o.id, Type: TypeStockRefused,
				Payload: StockRefused{OrderID: o.id, Reason: reason, Detail: detail}, Headers: tracing.Headers(msgs[i].Context())})
			continue
		}
		for _, l := range o.lines {
			change(i, o, l, l.Quantity, ReasonOrder)
		}
		r.state, r.lines, r.dirty = stateServed, o.lines, true
	}
	ps, qs := make([]string, 0, len(taken)), make([]int32, 0, len(taken))
	for _, p := range products {
		if q, ok := taken[p]; ok && q != 0 {
			ps, qs = append(ps, p), append(qs, int32(q)) // |q| <= an INTEGER stock
		}
	}
	if len(ps) > 0 {
		tag, err := tx.Exec(ctx, takeStock, ps, qs)
		if err != nil {
			return nil, fmt.Errorf("inventari: take estoc: %w", err)
		}
		if tag.RowsAffected() != int64(len(ps)) {
			return nil, fmt.Errorf("inventari: take estoc: %d rows updated, want %d", tag.RowsAffected(), len(ps))
		}
	}
	if err := writeOrders(ctx, tx, recs); err != nil {
		return nil, err
	}
	if len(events) > 0 {
		if err := s.cfg.Outbox.EnqueueBatch(ctx, tx, events); err != nil {
			return nil, err
		}
	}
	return outcomes, nil
}

// order is a decoded comanda.creada: its id and its lines summed per
// product, in product order.
type order struct {
	id     string
	lines  []Line
	cancel bool // comanda.cancellada: no lines
}

func decodeOrder(m *consumer.Message) (order, error) {
	var o orderCreated
	if err := strictjson.Unmarshal(m.Envelope.Data, &o); err != nil {
		return order{}, outcome.Permanentf("esquema: comanda.creada: %v", err)
	}
	if o.ID == "" || len(o.Lines) == 0 {
		return order{}, outcome.Permanentf("esquema: comanda.creada without id or linies")
	}
	if err := requestreply.CheckID("esquema: comanda.creada: id", o.ID, 0); err != nil {
		return order{}, err
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
			return nil, outcome.Permanentf("esquema: linies[%d]: empty producte or quantitat %d", i, l.Quantity)
		}
		if strings.ContainsRune(l.Product, 0) || !utf8.ValidString(l.Product) {
			return nil, outcome.Permanentf("esquema: linies[%d]: producte with a NUL character or invalid UTF-8", i)
		}
		if l.Quantity > math.MaxInt32 || perProduct[l.Product] > math.MaxInt32-l.Quantity {
			return nil, outcome.Permanentf("esquema: linies[%d]: quantitat of %s too large", i, l.Product)
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
			return outcome.Permanent(fmt.Errorf("%w: %s (%d left, %d asked)", ErrInsufficient, l.Product, have, l.Quantity))
		}
	}
	return nil
}
