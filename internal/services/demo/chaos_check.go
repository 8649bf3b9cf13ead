package demo

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/system"
)

// PoisonResult is what happened to one poison record, per group of its topic.
type PoisonResult struct {
	*Poison
	// Groups: per group, "dead-lettered <motiu> (attempts N, …)" or
	// "ignored", and a "FAIL: ..." when it is not what Expect says.
	Groups map[string]string `json:"groups"`
	// After: per group, the first healthy record after it in its partition
	// that the group handles, and whether the group processed it.
	After map[string]string `json:"next_healthy"`
	OK    bool              `json:"ok"`
}

// letter is one dead-letter or retry copy, with its source position.
type letter struct {
	topic, group, motiu, attempts, orderID, eventID string
	srcTopic                                        string
	srcPartition                                    int32
	srcOffset                                       int64
}

type chaosOrder struct {
	state string
	total int64
}

type pos struct {
	topic     string
	partition int32
	offset    int64
}

func (l letter) src() pos { return pos{l.srcTopic, l.srcPartition, l.srcOffset} }

func readLetters(ctx context.Context, kcl *kgo.Client, brokers []string, topic string) ([]letter, error) {
	recs, err := readTopic(ctx, kcl, brokers, topic)
	if err != nil {
		return nil, err
	}
	out := make([]letter, 0, len(recs))
	for _, rec := range recs {
		l := letter{topic: topic, group: header(rec, contract.HeaderGroup), motiu: header(rec, contract.HeaderReason),
			attempts: header(rec, contract.HeaderAttempts), eventID: header(rec, contract.HeaderEventID),
			srcTopic: header(rec, contract.HeaderOriginalTopic)}
		p, _ := strconv.ParseInt(header(rec, contract.HeaderOriginalPartition), 10, 32)
		l.srcPartition = int32(p)
		l.srcOffset, _ = strconv.ParseInt(header(rec, contract.HeaderOriginalOffset), 10, 64)
		if env, err := envelope.Decode(rec.Value); err == nil {
			var d struct {
				ID      string `json:"id"`
				OrderID string `json:"comanda_id"`
			}
			_ = json.Unmarshal(env.Data, &d)
			l.orderID = cmp.Or(d.ID, d.OrderID)
		}
		out = append(out, l)
	}
	return out, nil
}

func scanPair[K comparable, V any](ctx context.Context, pool *pgxpool.Pool, sql string) (map[K]V, error) {
	rows, err := pool.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	out := map[K]V{}
	var k K
	var v V
	_, err = pgx.ForEachRow(rows, []any{&k, &v}, func() error { out[k] = v; return nil })
	return out, err
}

// reconcile checks the run from the databases and by reading the topics.
func (c *chaos) reconcile(ctx context.Context, plan []*planned, sub Submissions, restock map[string]int, r *ChaosReport) error {
	pools, err := c.pools(ctx)
	if err != nil {
		return err
	}
	defer closePools(pools)
	r.Orders = sub
	brokers := c.brokers

	// 1. Orders: every accepted order exists once, with one comanda.creada.
	orders := map[string]chaosOrder{}
	rows, err := pools[comandes.Name].Query(ctx, `SELECT id, estat, import_centims FROM comandes`)
	if err != nil {
		return err
	}
	var o chaosOrder
	var id string
	if _, err := pgx.ForEachRow(rows, []any{&id, &o.state, &o.total}, func() error { orders[id] = o; return nil }); err != nil {
		return err
	}
	missing := 0
	for oid := range sub.accepted {
		if _, ok := orders[oid]; !ok {
			missing++
		}
	}
	created, err := scanPair[string, int](ctx, pools[comandes.Name], `SELECT agregat_id, count(*)::int FROM outbox WHERE tipus = 'comanda.creada' GROUP BY 1`)
	if err != nil {
		return err
	}
	notOnce := 0
	for oid := range orders {
		if created[oid] != 1 {
			notOnce++
		}
	}
	r.check("every accepted order stored once: a row in km0_comandes, one comanda.creada", len(orders) == sub.Accepted && missing == 0 && notOnce == 0 && len(created) == len(orders),
		"%d answers 201, %d orders in km0_comandes, %d accepted without a row, %d without exactly one comanda.creada", sub.Accepted, len(orders), missing, notOnce)
	r.check("no duplicate order, every order answered: a repeated Idempotency-Key gets the first answer",
		sub.ReplayDiffers == 0 && sub.Unexpected == 0 && sub.Other == 0 && sub.Unanswered == 0 && sub.Conflict == 0,
		"%d repeats with the first answer, %d with another, %d unexpected answers, %d conflicts 409, %d unanswered, %d answers 503 retried",
		sub.Replayed, sub.ReplayDiffers, sub.Unexpected+sub.Other, sub.Conflict, sub.Unanswered, sub.Unavailable)

	// 2. Every outbox row published and on its topic, in order per aggregate.
	r.Events = map[string]TopicCount{}
	topicRecs := map[string][]*kgo.Record{}
	outboxIDs := map[string]bool{} // every healthy event id
	for _, s := range publishing {
		topic := system.Topics[s]
		recs, err := readTopic(ctx, c.kcl, brokers, topic)
		if err != nil {
			return err
		}
		topicRecs[topic] = recs
		tc, order, parked, err := c.checkTopic(ctx, pools[s], recs, outboxIDs)
		if err != nil {
			return err
		}
		r.Events[topic] = tc
		r.check("no event lost, in order per aggregate: "+topic,
			tc.Pending == 0 && tc.Missing == 0 && tc.Distinct >= tc.OutboxRows && order == 0 && parked == 0,
			"%d outbox rows, %d pending, %d parked, %d records (%d distinct ids, %d republished), %d lost, %d aggregates out of order",
			tc.OutboxRows, tc.Pending, parked, tc.Records, tc.Distinct, tc.Republished, tc.Missing, order)
	}

	// 3. Dead letters and retries.
	var dls, retries []letter
	for _, s := range publishing {
		t := system.Topics[s]
		d, err := readLetters(ctx, c.kcl, brokers, t+contract.DLQSuffix)
		if err != nil {
			return err
		}
		dls = append(dls, d...)
		rt, err := readLetters(ctx, c.kcl, brokers, t+contract.RetrySuffix)
		if err != nil {
			return err
		}
		retries = append(retries, rt...)
	}
	r.DLQ = map[string]int{}
	for _, dl := range dls {
		r.DLQ[dl.group+" · "+reasonKey(dl.motiu)]++
	}
	c.mu.Lock()
	poison := append([]*Poison(nil), c.poison...)
	c.mu.Unlock()
	poisonAt := map[pos]bool{}
	for _, p := range poison {
		poisonAt[pos{p.Topic, p.Partition, p.Offset}] = true
	}
	insufficient := map[string]bool{}
	for _, dl := range dls {
		if dl.group == inventari.ConsumerDecrement && strings.Contains(dl.motiu, inventari.ErrInsufficient.Error()) && !poisonAt[dl.src()] {
			insufficient[dl.orderID] = true
		}
	}

	comp, err := compensate(ctx, pools, plan, insufficient)
	if err != nil {
		return err
	}
	r.Compensation = comp
	r.check("cancelled orders compensated (by the client or for stock): stock given back, refunded once, courier released",
		comp.ok() && sub.Cancelled == comp.ByReason[comandes.ReasonClient] && sub.CancelDiffers == 0, "%s; %d client cancellations answered 200", comp, sub.Cancelled)
	r.check("no order rejected by repartiment stays charged: each cancelled (ciutat_no_coberta) and refunded once, or never charged",
		comp.RejectedNotCancelled == 0 && comp.RejectedCharged == 0 && comp.ByReason[comandes.ReasonNotCovered] == comp.Rejected,
		"%d rejected, %d cancelled for ciutat_no_coberta, %d not cancelled, %d left charged; %d orders to %s refused with 422",
		comp.Rejected, comp.ByReason[comandes.ReasonNotCovered], comp.RejectedNotCancelled, comp.RejectedCharged, sub.NotCovered, UncoveredCity)
	if err := c.checkStock(ctx, pools, plan, sub, restock, insufficient, comp.cancelled, dls, r); err != nil {
		return err
	}
	paid, err := c.checkPayments(ctx, pools, orders, sub, comp, dls, poisonAt, r)
	if err != nil {
		return err
	}
	if err := c.checkDeliveries(ctx, pools, plan, sub, paid, comp, dls, poisonAt, r); err != nil {
		return err
	}
	c.checkUnexpectedLetters(plan, dls, poisonAt, r)
	return c.checkPoison(ctx, pools, poison, dls, retries, topicRecs, outboxIDs, r)
}

// checkTopic compares a service's outbox with its topic: every row's id is on
// the topic, and per aggregate the first copies of the ids come in the
// outbox's commit order (creat_en, see migrate/sql/outbox).
func (c *chaos) checkTopic(ctx context.Context, pool *pgxpool.Pool, recs []*kgo.Record, healthy map[string]bool) (TopicCount, int, int, error) {
	rows, err := pool.Query(ctx, `SELECT id::text, agregat_id, publicat_en IS NULL FROM outbox ORDER BY agregat_id, creat_en, id`)
	if err != nil {
		return TopicCount{}, 0, 0, err
	}
	want := map[string][]string{}
	var tc TopicCount
	var id, agg string
	var pending bool
	if _, err := pgx.ForEachRow(rows, []any{&id, &agg, &pending}, func() error {
		want[agg] = append(want[agg], id)
		healthy[id] = true
		tc.OutboxRows++
		if pending {
			tc.Pending++
		}
		return nil
	}); err != nil {
		return tc, 0, 0, err
	}
	var parked int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_aparcats`).Scan(&parked); err != nil {
		return tc, 0, 0, err
	}
	outOfOrder := compareTopic(want, recs, &tc)
	return tc, outOfOrder, parked, nil
}

// compareTopic reads recs (each partition in offset order) against want, the
// outbox ids of each aggregate in commit order: it counts into tc the records,
// distinct and republished ids and the ids missing from the topic, and
// returns how many aggregates' first copies are not in want's order. Records
// whose id is in no outbox (poison records) are skipped.
func compareTopic(want map[string][]string, recs []*kgo.Record, tc *TopicCount) int {
	healthy := map[string]bool{}
	for _, ids := range want {
		for _, id := range ids {
			healthy[id] = true
		}
	}
	seen := map[string]bool{}
	got := map[string][]string{}
	for _, rec := range recs {
		eid := header(rec, contract.HeaderEventID)
		if !healthy[eid] {
			continue
		}
		if seen[eid] {
			tc.Republished++
			continue
		}
		seen[eid] = true
		got[string(rec.Key)] = append(got[string(rec.Key)], eid)
	}
	tc.Records, tc.Distinct = len(recs), len(seen)
	outOfOrder := 0
	for agg, ids := range want {
		for _, id := range ids {
			if !seen[id] {
				tc.Missing++
			}
		}
		if !slices.Equal(ids, got[agg]) {
			outOfOrder++
		}
	}
	return outOfOrder
}

func (c *chaos) checkStock(ctx context.Context, pools map[string]*pgxpool.Pool, plan []*planned, sub Submissions, restock map[string]int,
	insufficient, cancelled map[string]bool, dls []letter, r *ChaosReport) error {
	final, err := scanPair[string, int](ctx, pools[inventari.Name], `SELECT producte, unitats FROM estoc`)
	if err != nil {
		return err
	}
	lines, err := scanPair[string, int](ctx, pools[comandes.Name], `SELECT comanda_id || '/' || producte, sum(quantitat)::int FROM linies_comanda GROUP BY 1`)
	if err != nil {
		return err
	}
	took := map[string]int{}
	for k, n := range lines {
		oid, prod, _ := strings.Cut(k, "/")
		if !insufficient[oid] && !cancelled[oid] { // a cancelled order's units are given back
			took[prod] += n
		}
	}
	// What inventari says it applied: its own estoc.actualitzat events of
	// motiu comanda, less those of motiu cancellacio (units given back).
	applied, err := scanPair[string, int](ctx, pools[inventari.Name], `SELECT carrega->>'producte', sum((carrega->>'abans')::int - (carrega->>'despres')::int)::int
		FROM outbox WHERE tipus = 'estoc.actualitzat' AND carrega->>'motiu' IN ('comanda', 'cancellacio') GROUP BY 1`)
	if err != nil {
		return err
	}
	restocked, err := scanPair[string, int](ctx, pools[inventari.Name], `SELECT carrega->>'producte', sum((carrega->>'despres')::int - (carrega->>'abans')::int)::int
		FROM outbox WHERE tipus = 'estoc.actualitzat' AND carrega->>'motiu' = 'reposicio' GROUP BY 1`)
	if err != nil {
		return err
	}
	flags := map[string]cataleg.Flag{}
	rows, err := pools[cataleg.Name].Query(ctx, `SELECT producte, unitats, estoc_baix FROM indicadors`)
	if err != nil {
		return err
	}
	var f cataleg.Flag
	if _, err := pgx.ForEachRow(rows, []any{&f.Product, &f.Units, &f.LowStock}, func() error { flags[f.Product] = f; return nil }); err != nil {
		return err
	}
	r.Stock = map[string]StockLine{}
	var bad, badCatalog []string
	for prod, initial := range inventari.InitialStock {
		l := StockLine{Initial: initial, Restocked: restock[prod], Accepted: took[prod], Final: final[prod],
			Catalog: flags[prod].Units, LowStock: flags[prod].LowStock}
		l.Expected = l.Initial + l.Restocked - l.Accepted
		r.Stock[prod] = l
		if l.Expected != l.Final || applied[prod] != took[prod] || restocked[prod] != restock[prod] {
			bad = append(bad, fmt.Sprintf("%s (expected %d, final %d, applied by inventari %d of %d, restocked %d of %d)",
				prod, l.Expected, l.Final, applied[prod], took[prod], restocked[prod], restock[prod]))
		}
		fl, ok := flags[prod]
		if changed := applied[prod] != 0 || restock[prod] != 0; ok || changed {
			if !ok || fl.Units != l.Final || fl.LowStock != (l.Final < cataleg.LowStockBelow) {
				badCatalog = append(badCatalog, fmt.Sprintf("%s (cataleg %d units, low stock %s; inventari %d)", prod, fl.Units, yesNo(fl.LowStock), l.Final))
			}
		}
	}
	r.check("stock exact: final = initial + restocked − applied", len(bad) == 0, "products that do not reconcile: %s", listOr(bad, "none"))
	doubled, err := doubleDecrements(ctx, pools[inventari.Name])
	if err != nil {
		return err
	}
	r.check("no order taken from stock twice", doubled == 0, "%d (order, product) pairs taken more than once", doubled)
	cheeseAccepted := acceptedCheeseOrders(plan, sub)
	served := min(cheeseAccepted, inventari.InitialStock[Cheese]/CheesePerOrder)
	r.check(onlyCheeseInvariant, len(insufficient) == cheeseAccepted-served && took[Cheese] == served*CheesePerOrder,
		"%d orders with aged cheese, %d served (%d expected), %d dead-lettered estoc_insuficient",
		cheeseAccepted, took[Cheese]/CheesePerOrder, served, len(insufficient))
	r.check(catalogInvariant, len(badCatalog) == 0, "%d flags; not matching: %s", len(flags), listOr(badCatalog, "none"))
	return nil
}

// checkPayments: one payment and one gateway charge per accepted order, and
// every one marked paid. It returns the paid orders.
func (c *chaos) checkPayments(ctx context.Context, pools map[string]*pgxpool.Pool, orders map[string]chaosOrder, sub Submissions, comp *Compensation, dls []letter, poisonAt map[pos]bool, r *ChaosReport) (map[string]bool, error) {
	type pay struct {
		total int64
		ref   string
	}
	payments := map[string]pay{}
	rows, err := pools[pagaments.Name].Query(ctx, `SELECT comanda_id, import_centims, ref_passarella FROM pagaments`)
	if err != nil {
		return nil, err
	}
	var id string
	var p pay
	if _, err := pgx.ForEachRow(rows, []any{&id, &p.total, &p.ref}, func() error { payments[id] = p; return nil }); err != nil {
		return nil, err
	}
	charges := map[string]pay{}
	calls := 0
	rows, err = pools[pagaments.Name].Query(ctx, `SELECT comanda_id, import_centims, ref, crides FROM passarella.cobraments`)
	if err != nil {
		return nil, err
	}
	var n int
	dupCharges := 0
	if _, err := pgx.ForEachRow(rows, []any{&id, &p.total, &p.ref, &n}, func() error {
		if _, dup := charges[id]; dup {
			dupCharges++
		}
		charges[id] = p
		calls += n
		return nil
	}); err != nil {
		return nil, err
	}
	ps := PaymentSummary{Payments: len(payments), GatewayCharges: len(charges)}
	paid := map[string]bool{}
	for oid, o := range orders {
		if o.state == "pagada" {
			ps.OrdersPaid++
			paid[oid] = true
		}
		pm, ok := payments[oid]
		if !ok {
			if !comp.cancelled[oid] { // a cancelled order may never have been charged (Compensation)
				ps.Unpaid++
			}
			continue
		}
		ch, ok := charges[oid]
		if !ok || ch.ref != pm.ref || ch.total != o.total || pm.total != o.total {
			ps.WrongAmount++
		}
	}
	for oid := range charges {
		if _, ok := payments[oid]; !ok && !comp.cancelled[oid] { // a cancelled order's: refunded (Compensation)
			ps.ChargedTwice++ // a charge with no payment: outside the books
		}
	}
	ps.ChargedTwice += dupCharges
	ps.GatewayReplays = calls - len(charges)
	r.Payments = ps
	chargeDLQ := 0
	for _, dl := range dls {
		if dl.group == pagaments.ConsumerCharge && !poisonAt[dl.src()] {
			chargeDLQ++
		}
	}
	r.check("every paid order charged exactly once at the gateway: one payment, one charge, marked pagada",
		ps.Payments == sub.Accepted-comp.NeverCharged-comp.ChargedUnbooked && ps.GatewayCharges == ps.Payments+comp.ChargedUnbooked &&
			ps.OrdersPaid == ps.Payments-(comp.Charged-comp.ChargedUnbooked) && ps.WrongAmount == 0 && ps.ChargedTwice == 0 && ps.Unpaid == 0 && chargeDLQ == 0,
		"%d accepted, %d payments, %d charges, %d marked pagada, %d unpaid, %d wrong amounts or references, %d surplus charges, %d dead-lettered by the charge consumer; %d repeated gateway calls absorbed",
		sub.Accepted, ps.Payments, ps.GatewayCharges, ps.OrdersPaid, ps.Unpaid, ps.WrongAmount, ps.ChargedTwice, chargeDLQ, ps.GatewayReplays)
	return paid, nil
}

// checkDeliveries: every paid order handled by repartiment: assigned,
// rejected (city not covered) or dead-lettered for its schema (v1, no address).
func (c *chaos) checkDeliveries(ctx context.Context, pools map[string]*pgxpool.Pool, plan []*planned, sub Submissions, paid map[string]bool,
	comp *Compensation, dls []letter, poisonAt map[pos]bool, r *ChaosReport) error {
	states, err := scanPair[string, string](ctx, pools[repartiment.Name], `SELECT comanda_id, estat FROM lliuraments`)
	if err != nil {
		return err
	}
	schemaDLQ, notCovered := map[string]bool{}, map[string]bool{}
	for _, dl := range dls {
		if dl.group != repartiment.ConsumerAssign || poisonAt[dl.src()] {
			continue
		}
		switch reasonKey(dl.motiu) {
		case "permanent: " + repartiment.ReasonSchema:
			schemaDLQ[dl.orderID] = true
		case "permanent: " + repartiment.ReasonNotCovered:
			notCovered[dl.orderID] = true
		}
	}
	byPlan := map[string]*planned{}
	for _, p := range plan {
		byPlan[p.order.ID] = p
	}
	count := map[string]int{}
	var wrong []string
	for oid := range paid {
		p := byPlan[oid]
		st := states[oid]
		count[cmp.Or(st, "cap")]++
		ok := false
		switch {
		case p == nil:
		case p.uncovered:
			ok = st == repartiment.StateRejected && notCovered[oid]
		case p.legacy:
			ok = st == "" && schemaDLQ[oid]
		default:
			ok = st == repartiment.StateAssigned
		}
		if !ok && len(wrong) < 10 {
			wrong = append(wrong, fmt.Sprintf("%s (estat %q)", oid, st))
		} else if !ok {
			wrong = append(wrong, "…")
		}
	}
	extra := 0
	for oid := range states {
		if !paid[oid] && !comp.cancelled[oid] { // a cancelled order's row: Compensation
			extra++
		}
	}
	assignedEv, err := countOf(ctx, pools[repartiment.Name], `SELECT count(*) FROM outbox WHERE tipus = 'repartiment.assignat'`)
	if err != nil {
		return err
	}
	rejectedEv, err := countOf(ctx, pools[repartiment.Name], `SELECT count(*) FROM outbox WHERE tipus = 'repartiment.rebutjat'`)
	if err != nil {
		return err
	}
	r.Deliveries = map[string]int{repartiment.StateAssigned: count[repartiment.StateAssigned], repartiment.StatePending: count[repartiment.StatePending],
		repartiment.StateRejected: count[repartiment.StateRejected], "dlq_esquema": len(schemaDLQ), "no_delivery": count["cap"]}
	r.check("every paid order handled by repartiment: assigned, rejected for an uncovered city, or dead-lettered esquema if versio 1",
		len(wrong) == 0 && extra == 0 && assignedEv == count[repartiment.StateAssigned]+comp.Released && rejectedEv == count[repartiment.StateRejected],
		"%d paid: %d assigned (%d repartiment.assignat), %d rejected (%d repartiment.rebutjat), %d dead-lettered esquema, %d deliveries of unpaid orders; not matching: %s",
		len(paid), count[repartiment.StateAssigned], assignedEv, count[repartiment.StateRejected], rejectedEv, len(schemaDLQ), extra, listOr(wrong, "none"))
	return nil
}

// checkUnexpectedLetters: besides the poison records, only the business
// dead letters of the plan: cheese out of stock, a city not covered, a v1
// order without address. Anything else (e.g. "transitori esgotat" during a
// restart) is an event whose effect was not applied.
func (c *chaos) checkUnexpectedLetters(plan []*planned, dls []letter, poisonAt map[pos]bool, r *ChaosReport) {
	byPlan := map[string]*planned{}
	for _, p := range plan {
		byPlan[p.order.ID] = p
	}
	var bad []string
	for _, dl := range dls {
		if poisonAt[dl.src()] {
			continue
		}
		p := byPlan[dl.orderID]
		ok := p != nil && ((dl.group == inventari.ConsumerDecrement && p.cheese && strings.HasPrefix(dl.motiu, "permanent: "+inventari.ErrInsufficient.Error()+": "+Cheese)) ||
			(dl.group == repartiment.ConsumerAssign && p.uncovered && reasonKey(dl.motiu) == "permanent: "+repartiment.ReasonNotCovered) ||
			(dl.group == repartiment.ConsumerAssign && p.legacy && reasonKey(dl.motiu) == "permanent: "+repartiment.ReasonSchema))
		if !ok {
			bad = append(bad, fmt.Sprintf("%s %s/%d@%d %q", dl.group, dl.srcTopic, dl.srcPartition, dl.srcOffset, dl.motiu))
		}
	}
	if len(bad) > 10 {
		bad = append(bad[:10], fmt.Sprintf("… (%d in all)", len(bad)))
	}
	r.check("no unexpected dead letter: only the poison records and the plan's business refusals", len(bad) == 0, "unexpected: %s", listOr(bad, "none"))
}

// checkPoison: every poison record dead-lettered at its first attempt with
// its motiu by each group that must, ignored by the others, and the first
// healthy record after it in its partition processed by each group.
func (c *chaos) checkPoison(ctx context.Context, pools map[string]*pgxpool.Pool, poison []*Poison, dls, retries []letter,
	topicRecs map[string][]*kgo.Record, healthy map[string]bool, r *ChaosReport) error {
	byPos := map[pos][]letter{}
	for _, dl := range dls {
		byPos[dl.src()] = append(byPos[dl.src()], dl)
	}
	retried := map[pos][]letter{}
	for _, rt := range retries {
		retried[rt.src()] = append(retried[rt.src()], rt)
	}
	committed := map[string]kadm.OffsetResponses{}
	adm := kadm.NewClient(c.kcl)
	for _, g := range c.chaosGroups() {
		offs, err := adm.FetchOffsets(ctx, g)
		if err != nil {
			return fmt.Errorf("offsets of %s: %w", g, err)
		}
		committed[g] = offs
	}
	processed := func(g string, rec *kgo.Record) (bool, error) {
		if svcName, ok := inboxGroups[g]; ok {
			var n int
			err := pools[svcName].QueryRow(ctx, `SELECT count(*) FROM missatges_processats WHERE id_missatge = $1 AND consumidor = $2`,
				header(rec, contract.HeaderEventID), g).Scan(&n)
			if err != nil || n > 0 {
				return n > 0, err
			}
			for _, dl := range byPos[pos{rec.Topic, rec.Partition, rec.Offset}] {
				if dl.group == g {
					return true, nil // dead-lettered for a business reason: handled
				}
			}
			return false, nil
		}
		o, ok := committed[g].Lookup(rec.Topic, rec.Partition)
		return ok && o.Err == nil && o.At > rec.Offset, nil
	}
	dlqOK, afterOK := true, true
	nDLQ, nIgnored, checkedAfter := 0, 0, 0
	for _, p := range poison {
		res := &PoisonResult{Poison: p, Groups: map[string]string{}, After: map[string]string{}, OK: true}
		at := pos{p.Topic, p.Partition, p.Offset}
		for g, want := range p.Expect {
			var mine []letter
			for _, dl := range byPos[at] {
				if dl.group == g {
					mine = append(mine, dl)
				}
			}
			retriedBy := 0
			for _, rt := range retried[at] {
				if rt.group == g {
					retriedBy++
				}
			}
			var got string
			ok := true
			switch {
			case want == "" && len(mine) == 0 && retriedBy == 0:
				got = "ignored"
				nIgnored++
			case want == "":
				ok = false
				got = fmt.Sprintf("FAIL: should have been ignored; %d dead-lettered, %d retried", len(mine), retriedBy)
			case len(mine) == 0:
				ok = false
				got = fmt.Sprintf("FAIL: not dead-lettered (expected %q); %d retried", want, retriedBy)
			default:
				got = fmt.Sprintf("dead-lettered %q (attempts %s, %d copies)", mine[0].motiu, mine[0].attempts, len(mine))
				for _, m := range mine {
					if m.attempts != "1" || !strings.HasPrefix(m.motiu, want) {
						ok = false
					}
				}
				if retriedBy > 0 {
					ok = false
				}
				if !ok {
					got = "FAIL: " + got + fmt.Sprintf(", %d retried; expected %q at attempt 1", retriedBy, want)
				} else {
					nDLQ++
				}
			}
			res.Groups[g] = got
			res.OK = res.OK && ok
			dlqOK = dlqOK && ok
		}
		if p.Expect[repartiment.ConsumerAssign] == motiuNoAddress {
			// CONTRACT.md: DLQ esquema + alert.
			var n int
			if err := pools[repartiment.Name].QueryRow(ctx, `SELECT count(*) FROM alertes WHERE id_esdeveniment = $1`, p.ID).Scan(&n); err != nil {
				return err
			}
			if n != 1 {
				res.Groups[repartiment.ConsumerAssign] += fmt.Sprintf("; FAIL: %d alerts (expected 1)", n)
				res.OK, dlqOK = false, false
			} else {
				res.Groups[repartiment.ConsumerAssign] += "; alert stored"
			}
		}
		for _, g := range topicGroups[p.Topic] {
			var next *kgo.Record
			for _, rec := range topicRecs[p.Topic] {
				if rec.Partition != p.Partition || rec.Offset <= p.Offset || !healthy[header(rec, contract.HeaderEventID)] {
					continue
				}
				if t := handledBy[g]; t == "" || header(rec, contract.HeaderType) == t {
					next = rec
					break
				}
			}
			if next == nil {
				res.After[g] = "FAIL: no healthy record after it in the partition"
				res.OK, afterOK = false, false
				continue
			}
			checkedAfter++
			done, err := processed(g, next)
			if err != nil {
				return err
			}
			res.After[g] = fmt.Sprintf("offset %d (%s %s): processed %s", next.Offset, header(next, contract.HeaderType), header(next, contract.HeaderEventID), yesNo(done))
			if !done {
				res.After[g] = "FAIL: " + res.After[g]
				res.OK, afterOK = false, false
			}
		}
		r.Poison = append(r.Poison, res)
	}
	var bad []string
	for _, p := range r.Poison {
		if !p.OK {
			bad = append(bad, fmt.Sprintf("%s %s/%d@%d: %s; after it: %s", p.Name, p.Topic, p.Partition, p.Offset, mapText(p.Groups), mapText(p.After)))
		}
	}
	want := PoisonBatches * poisonPerBatch
	r.check("every poison record dead-lettered at its first attempt with its motiu: or ignored where the group does not handle its tipus", dlqOK && len(poison) == want,
		"%d poison records produced (of %d), %d dead letters at the first attempt with the expected motiu, %d ignored as they should be; not matching: %s",
		len(poison), want, nDLQ, nIgnored, listOr(bad, "none"))
	r.check("no poison record blocks a partition: each group processed the healthy event after each one", afterOK && len(poison) == want,
		"%d (poison record, group) pairs checked", checkedAfter)
	return nil
}

// mapText writes a map of strings as "k1: v1; k2: v2" in key order.
func mapText(m map[string]string) string {
	parts := make([]string, 0, len(m))
	for _, k := range sortedKeys(m) {
		parts = append(parts, k+": "+m[k])
	}
	return listOr(parts, "none")
}
