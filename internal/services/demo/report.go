package demo

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/system"
)

// Report is the reconciliation of one demo run.
type Report struct {
	Run          string                   `json:"run"`
	Database     string                   `json:"database"`
	RequestReply string                   `json:"request_reply"`
	EventsBroker string                   `json:"events_broker"` // Kafka, RabbitMQ, or Kafka with some topics on RabbitMQ
	Elapsed      float64                  `json:"seconds"`
	Orders       Submissions              `json:"orders"`
	Events       map[string]TopicCount    `json:"events"`
	Consumers    map[string]ConsumerCount `json:"consumers"`
	DLQ          map[string]int           `json:"dead_letters_by_reason"` // "group · motiu class": distinct events (a crash before the offset commit dead-letters one again)
	Stock        map[string]StockLine     `json:"stock"`
	Payments     PaymentSummary           `json:"payments"`
	Deliveries   map[string]int           `json:"deliveries"` // by lliuraments.estat, plus dlq_esquema and alertes
	Analytics    *analitica.Counters      `json:"analytics,omitempty"`
	Compensation *Compensation            `json:"compensation,omitempty"`
	Restarts     map[string]int           `json:"restarts"`
	Injected     map[string]bool          `json:"injected_failures"` // which injected failures fired (relay, consumer, charge)
	KafkaOutage  *KafkaOutage             `json:"kafka_outage,omitempty"`
	Invariants   []Invariant              `json:"invariants"`
	Verdict      string                   `json:"verdict"` // in words: what held, or what failed
	OK           bool                     `json:"ok"`
}

// TopicCount compares a service's outbox with its topic.
type TopicCount struct {
	OutboxRows  int `json:"outbox_rows"`
	Pending     int `json:"pending"`
	Records     int `json:"topic_records"`
	Distinct    int `json:"distinct_ids"`
	Missing     int `json:"lost"`        // outbox rows whose id never reached the topic
	Republished int `json:"republished"` // records − distinct: relay re-publications
}

// ConsumerCount is a consumer's counts over the run, restarts included.
type ConsumerCount struct {
	consumer.Stats
	Restarts int `json:"restarts"`
}

// StockLine reconciles one product.
type StockLine struct {
	Initial   int  `json:"initial"`
	Restocked int  `json:"restocked"`
	Accepted  int  `json:"accepted"` // units of orders inventari did not dead-letter
	Expected  int  `json:"expected"` // initial + restocked − accepted
	Final     int  `json:"final"`
	Catalog   int  `json:"catalog"`
	LowStock  bool `json:"low_stock"`
}

// PaymentSummary reconciles payments with the gateway.
type PaymentSummary struct {
	OrdersPaid      int `json:"orders_paid"`
	Payments        int `json:"payments"`
	GatewayCharges  int `json:"gateway_charges"`
	ChargedTwice    int `json:"charged_twice"`
	WrongAmount     int `json:"wrong_amount"`
	Unpaid          int `json:"accepted_unpaid"`
	GatewayFailures int `json:"gateway_503"`
	GatewayHangs    int `json:"gateway_hangs"`
	GatewayReplays  int `json:"gateway_replays"`
}

// Invariant is one check of the report.
type Invariant struct {
	Name   string `json:"name"` // "claim: how it is checked"; the claim is what the verdict says held
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
}

func (r *Report) check(name string, ok bool, format string, args ...any) {
	r.Invariants = append(r.Invariants, Invariant{Name: name, OK: ok, Detail: fmt.Sprintf(format, args...)})
}

// claim is the head of an invariant's name, before its first ": ".
func (inv Invariant) claim() string {
	c, _, _ := strings.Cut(inv.Name, ": ")
	return c
}

// verdict says in words what held: "20 of 20 invariants held: system
// settled, every accepted order stored, …", each claim once (the four
// "no event lost: <topic>" are one claim); or, when some failed, which.
func verdict(invs []Invariant) string {
	var held, failed []string
	seen := map[string]bool{}
	for _, inv := range invs {
		if !inv.OK {
			failed = append(failed, inv.Name)
			continue
		}
		if c := inv.claim(); !seen[c] {
			seen[c] = true
			held = append(held, c)
		}
	}
	if len(failed) > 0 {
		return fmt.Sprintf("NOT RECONCILED: %d of %d invariants failed: %s", len(failed), len(invs), strings.Join(failed, "; "))
	}
	return fmt.Sprintf("%d of %d invariants held: %s.", len(invs), len(invs), strings.Join(held, ", "))
}

// Failed returns the names of the invariants that do not hold.
func (r *Report) Failed() []string {
	var out []string
	for _, inv := range r.Invariants {
		if !inv.OK {
			out = append(out, inv.Name)
		}
	}
	return out
}

type deadLetter struct {
	topic, group, motiu, orderID, eventID string
}

// reasonKey groups a motiu by its class (contract.ReasonClass):
// "permanent: estoc_insuficient: x" → "permanent: estoc_insuficient".
func reasonKey(m string) string { return contract.ReasonClass(m) }

func queryMap[V any](ctx context.Context, pool *pgxpool.Pool, sql string, scan func(pgx.Rows) (string, V, error)) (map[string]V, error) {
	rows, err := pool.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]V{}
	for rows.Next() {
		k, v, err := scan(rows)
		if err != nil {
			return nil, err
		}
		out[k] = v
	}
	return out, rows.Err()
}

func countOf(ctx context.Context, pool *pgxpool.Pool, sql string) (int, error) {
	var n int
	err := pool.QueryRow(ctx, sql).Scan(&n)
	return n, err
}

// reconcile builds the report from the databases, the topics and the counters.
func reconcile(ctx context.Context, sys *system.System, ev *eventLog, plan []*planned, sub Submissions, restock map[string]int, r *Report) error {
	r.Orders = sub
	r.Restarts = sys.Restarts()
	cp := sys.Pool(comandes.Name)
	// 1. Orders.
	orders, err := queryMap(ctx, cp, `SELECT id, estat, import_centims FROM comandes`, func(rows pgx.Rows) (string, [2]any, error) {
		var id, st string
		var total int64
		err := rows.Scan(&id, &st, &total)
		return id, [2]any{st, total}, err
	})
	if err != nil {
		return err
	}
	missing := 0
	for id := range sub.accepted {
		if _, ok := orders[id]; !ok {
			missing++
		}
	}
	r.check("every accepted order stored: each 201 has its row in km0_comandes", len(orders) == sub.Accepted && missing == 0,
		"%d answers 201, %d orders in km0_comandes, %d accepted without a row", sub.Accepted, len(orders), missing)
	r.check("no duplicate order: a repeated Idempotency-Key gets the first answer", sub.ReplayDiffers == 0 && sub.Unexpected == 0 && sub.Other == 0,
		"%d repeats answered with the first answer, %d with another, %d unexpected answers", sub.Replayed, sub.ReplayDiffers, sub.Unexpected+sub.Other)

	// 2. Outbox rows against topics.
	r.Events = map[string]TopicCount{}
	for _, svcName := range []string{comandes.Name, inventari.Name, pagaments.Name, repartiment.Name} {
		topic := system.Topics[svcName]
		ids, err := queryMap(ctx, sys.Pool(svcName), `SELECT id::text, publicat_en IS NULL FROM outbox`, func(rows pgx.Rows) (string, bool, error) {
			var id string
			var pending bool
			err := rows.Scan(&id, &pending)
			return id, pending, err
		})
		if err != nil {
			return err
		}
		published, err := ev.eventIDs(ctx, topic)
		if err != nil {
			return err
		}
		seen := map[string]bool{}
		for _, id := range published {
			seen[id] = true
		}
		tc := TopicCount{OutboxRows: len(ids), Records: len(published), Distinct: len(seen), Republished: len(published) - len(seen)}
		for id, pending := range ids {
			if pending {
				tc.Pending++
			}
			if !seen[id] {
				tc.Missing++
			}
		}
		r.Events[topic] = tc
		r.check("no event lost: "+topic, tc.Pending == 0 && tc.Missing == 0 && tc.Distinct == tc.OutboxRows,
			"%d outbox rows, %d pending, %d records (%d distinct ids, %d republished), %d lost",
			tc.OutboxRows, tc.Pending, tc.Records, tc.Distinct, tc.Republished, tc.Missing)
	}

	// 3. Dead letters.
	dls, err := ev.deadLetters(ctx)
	if err != nil {
		return err
	}
	r.DLQ = map[string]int{}
	dlqBy := func(group, reason string) map[string]bool {
		out := map[string]bool{}
		for _, dl := range dls {
			if dl.group == group && reasonKey(dl.motiu) == reason {
				out[dl.orderID] = true
			}
		}
		return out
	}
	counted := map[string]bool{}
	for _, dl := range dls {
		k := dl.group + " · " + reasonKey(dl.motiu)
		if dl.eventID == "" || !counted[k+"\x00"+dl.eventID] {
			counted[k+"\x00"+dl.eventID] = true
			r.DLQ[k]++
		}
	}
	// 4. Consumers.
	stats := sys.ConsumerStats()
	r.Consumers = map[string]ConsumerCount{}
	for g, st := range stats {
		r.Consumers[g] = ConsumerCount{Stats: st, Restarts: r.Restarts["consumer "+g]}
	}

	insufficient := dlqBy(inventari.ConsumerDecrement, "permanent: "+inventari.ErrInsufficient.Error())
	pools := map[string]*pgxpool.Pool{}
	for _, name := range []string{comandes.Name, inventari.Name, pagaments.Name, repartiment.Name} {
		pools[name] = sys.Pool(name)
	}
	comp, err := compensate(ctx, pools, plan, insufficient)
	if err != nil {
		return err
	}
	r.Compensation = comp
	r.checkCancellations(plan, sub, insufficient, comp)
	if err := reconcileStock(ctx, sys, plan, sub, restock, insufficient, comp.cancelled, dls, r); err != nil {
		return err
	}
	if err := reconcilePayments(ctx, sys, orders, sub, comp, dls, r); err != nil {
		return err
	}
	if err := reconcileDeliveries(ctx, sys, plan, orders, sub, comp, dlqBy, r); err != nil {
		return err
	}
	if sys.Analitica != nil {
		if r.Analytics, err = sys.Analitica.Counters(ctx); err != nil {
			return err
		}
		if err := checkAnalytics(ctx, pools, r); err != nil {
			return err
		}
	}
	r.checkInjectedFailures(stats[inventari.ConsumerDecrement].Duplicates)
	return nil
}

// checkAnalytics checks that analitica (at most once) counted no event
// twice: per tipus, no more than the outbox rows of that tipus, though the
// relay republished some and inventari's consumer was restarted.
func checkAnalytics(ctx context.Context, pools map[string]*pgxpool.Pool, r *Report) error {
	rows := map[string]int{}
	for _, name := range []string{comandes.Name, inventari.Name, pagaments.Name, repartiment.Name} {
		per, err := queryMap(ctx, pools[name], `SELECT tipus, count(*)::int FROM outbox GROUP BY 1`, func(rs pgx.Rows) (string, int, error) {
			var k string
			var n int
			err := rs.Scan(&k, &n)
			return k, n, err
		})
		if err != nil {
			return err
		}
		for k, n := range per {
			rows[k] += n
		}
	}
	var over []string
	counted, lost := 0, 0
	for _, k := range slices.Sorted(maps.Keys(rows)) {
		n := int(r.Analytics.PerType[k])
		counted += n
		if n > rows[k] {
			over = append(over, fmt.Sprintf("%s %d of %d", k, n, rows[k]))
		}
		lost += max(rows[k]-n, 0)
	}
	for k := range r.Analytics.PerType {
		if _, ok := rows[k]; !ok {
			over = append(over, k+" counted, never written")
		}
	}
	total := 0
	for _, n := range rows {
		total += n
	}
	r.check("analitica counts no event twice", len(over) == 0,
		"%d events counted of %d written (%d lost, at most once); counted more than written: %s", counted, total, lost, listOr(over, "none"))
	return nil
}

// checkInjectedFailures checks that every injected failure fired and was
// recovered from: the relay and inventari's consumer were restarted, the
// consumer's redelivered batch was absorbed as duplicates, and the charge
// that died between the gateway and COMMIT fired (it leaves no restart: the
// retry absorbs it, so the hook itself says whether it fired).
func (r *Report) checkInjectedFailures(duplicates int64) {
	relay, cons := r.Restarts["relay "+comandes.Name], r.Restarts["consumer "+inventari.ConsumerDecrement]
	r.check(injectedInvariant, relay >= 1 && cons >= 1 && r.Injected[injectedCharge] && duplicates > 0,
		"comandes' relay restarted %d time(s), consumer %s restarted %d time(s), %d duplicates absorbed, crash between the gateway and COMMIT fired: %s",
		relay, inventari.ConsumerDecrement, cons, duplicates, yesNo(r.Injected[injectedCharge]))
}

func reconcileStock(ctx context.Context, sys *system.System, plan []*planned, sub Submissions, restock map[string]int, insufficient, cancelled map[string]bool, dls []deadLetter, r *Report) error {
	ip := sys.Pool(inventari.Name)
	final, err := sys.Inventari.Stock(ctx)
	if err != nil {
		return err
	}
	accepted, err := queryMap(ctx, sys.Pool(comandes.Name), `SELECT comanda_id || '/' || producte, sum(quantitat)::int FROM linies_comanda GROUP BY 1`,
		func(rows pgx.Rows) (string, int, error) {
			var k string
			var n int
			err := rows.Scan(&k, &n)
			return k, n, err
		})
	if err != nil {
		return err
	}
	took := map[string]int{}
	for k, n := range accepted {
		id, prod, _ := strings.Cut(k, "/")
		if !insufficient[id] && !cancelled[id] { // a cancelled order's units are given back
			took[prod] += n
		}
	}
	// Products whose stock changed: inventari's estoc.actualitzat events,
	// each of which cataleg must have turned into a flag.
	changed, err := queryMap(ctx, ip, `SELECT DISTINCT carrega->>'producte', true FROM outbox WHERE tipus = 'estoc.actualitzat'`,
		func(rows pgx.Rows) (string, bool, error) {
			var p string
			var b bool
			err := rows.Scan(&p, &b)
			return p, b, err
		})
	if err != nil {
		return err
	}
	flags := map[string]cataleg.Flag{}
	if sys.Cataleg != nil {
		fs, err := sys.Cataleg.Flags(ctx)
		if err != nil {
			return err
		}
		for _, f := range fs {
			flags[f.Product] = f
		}
	}
	r.Stock = map[string]StockLine{}
	stockOK, catalogOK := true, true
	var bad []string
	for prod, initial := range inventari.InitialStock {
		l := StockLine{Initial: initial, Restocked: restock[prod], Accepted: took[prod], Final: final[prod],
			Catalog: flags[prod].Units, LowStock: flags[prod].LowStock}
		l.Expected = l.Initial + l.Restocked - l.Accepted
		r.Stock[prod] = l
		if l.Expected != l.Final || l.Final < 0 {
			stockOK = false
			bad = append(bad, prod)
		}
		// A product whose stock changed must be flagged, and a flag must match.
		if _, ok := flags[prod]; ok || changed[prod] {
			if !ok || l.Catalog != l.Final || l.LowStock != (l.Final < cataleg.LowStockBelow) {
				catalogOK = false
			}
		}
	}
	r.check(stockInvariant, stockOK, "products that do not reconcile: %s", listOr(bad, "none"))
	doubled, err := doubleDecrements(ctx, ip)
	if err != nil {
		return err
	}
	r.check("no order taken from stock twice", doubled == 0, "%d (order, product) pairs taken more than once", doubled)
	cheeseAccepted := acceptedCheeseOrders(plan, sub)
	onlyCheese := true
	for _, dl := range dls {
		if dl.group == inventari.ConsumerDecrement && !strings.Contains(dl.motiu, "estoc_insuficient: "+Cheese) {
			onlyCheese = false
		}
	}
	// From the plan alone: the stock serves the first orders it has units
	// for, and every later one must be dead-lettered.
	served := min(cheeseAccepted, inventari.InitialStock[Cheese]/CheesePerOrder)
	r.check(onlyCheeseInvariant, onlyCheese && len(insufficient) == cheeseAccepted-served && took[Cheese] == served*CheesePerOrder,
		"%d orders with aged cheese, %d served (%d units of %d; %d expected), %d dead-lettered estoc_insuficient",
		cheeseAccepted, took[Cheese]/CheesePerOrder, took[Cheese], inventari.InitialStock[Cheese], served, len(insufficient))
	if sys.Cataleg != nil {
		r.check(catalogInvariant, catalogOK, "flags of %d products (%d whose stock changed)", len(flags), len(changed))
	}
	return nil
}

func reconcilePayments(ctx context.Context, sys *system.System, orders map[string][2]any, sub Submissions, comp *Compensation, dls []deadLetter, r *Report) error {
	payments, err := sys.Pagaments.Payments(ctx)
	if err != nil {
		return err
	}
	charges, err := sys.Gateway.Charges(ctx)
	if err != nil {
		return err
	}
	ps := PaymentSummary{Payments: len(payments), GatewayCharges: len(charges)}
	for id, o := range orders {
		if o[0] == "pagada" {
			ps.OrdersPaid++
		}
		p, ok := payments[id]
		if !ok {
			if !comp.cancelled[id] { // a cancelled order may never have been charged (Compensation)
				ps.Unpaid++
			}
			continue
		}
		c, ok := charges[pagaments.ChargeKey(id)]
		if !ok || c.Ref != p.GatewayRef || c.TotalCents != o[1].(int64) || p.TotalCents != o[1].(int64) {
			ps.WrongAmount++
		}
	}
	for key := range charges {
		id := strings.TrimPrefix(key, "cobrament-")
		if _, ok := payments[id]; !ok && !comp.cancelled[id] { // a cancelled order's: refunded (Compensation)
			ps.ChargedTwice++ // a charge with no payment record: charged outside the books
		}
	}
	st := sys.Gateway.Stats()
	ps.GatewayFailures, ps.GatewayHangs, ps.GatewayReplays = st.Failed, st.Hung, st.Replayed
	r.Payments = ps
	chargeDLQ := 0
	for _, dl := range dls {
		if dl.group == pagaments.ConsumerCharge {
			chargeDLQ++
		}
	}
	r.check("every paid order charged exactly once at the gateway",
		ps.Payments == sub.Accepted-comp.NeverCharged-comp.ChargedUnbooked && ps.GatewayCharges == ps.Payments+comp.ChargedUnbooked &&
			ps.OrdersPaid == ps.Payments-(comp.Charged-comp.ChargedUnbooked) && ps.WrongAmount == 0 && ps.ChargedTwice == 0 && ps.Unpaid == 0 && chargeDLQ == 0,
		"%d accepted (%d cancelled before the charge), %d payments, %d gateway charges (one key cobrament-<id> each), %d orders paid (%d charged and cancelled), %d unpaid, %d wrong amounts or references, %d charges without a record; the gateway failed %d time(s), hung %d time(s) and replayed %d answer(s)",
		sub.Accepted, comp.NeverCharged, ps.Payments, ps.GatewayCharges, ps.OrdersPaid, comp.Charged, ps.Unpaid, ps.WrongAmount, ps.ChargedTwice, ps.GatewayFailures, ps.GatewayHangs, ps.GatewayReplays)
	return nil
}

func reconcileDeliveries(ctx context.Context, sys *system.System, plan []*planned, orders map[string][2]any, sub Submissions, comp *Compensation, dlqBy func(group, reason string) map[string]bool, r *Report) error {
	rp := sys.Pool(repartiment.Name)
	states, err := scanPair[string, string](ctx, rp, `SELECT comanda_id, estat FROM lliuraments`)
	if err != nil {
		return err
	}
	// Per paid order (a cancelled one is reconciled by Compensation); a
	// rejected order is cancelled by its compensation, counted apart.
	sum := map[string]int{}
	for id, o := range orders {
		if o[0] == "pagada" && states[id] != "" && states[id] != repartiment.StateRejected {
			sum[states[id]]++
		}
	}
	for _, st := range states {
		if st == repartiment.StateRejected {
			sum[st]++
		}
	}
	notCovered := dlqBy(repartiment.ConsumerAssign, "permanent: "+repartiment.ReasonNotCovered)
	schema := dlqBy(repartiment.ConsumerAssign, "permanent: "+repartiment.ReasonSchema)
	for id := range schema {
		if comp.cancelled[id] {
			delete(schema, id)
		}
	}
	alerts, err := countOf(ctx, rp, `SELECT count(*) FROM alertes`)
	if err != nil {
		return err
	}
	assignedEv, err := countOf(ctx, rp, `SELECT count(*) FROM outbox WHERE tipus = 'repartiment.assignat'`)
	if err != nil {
		return err
	}
	rejectedEv, err := countOf(ctx, rp, `SELECT count(*) FROM outbox WHERE tipus = 'repartiment.rebutjat'`)
	if err != nil {
		return err
	}
	r.Deliveries = map[string]int{
		repartiment.StateAssigned: sum[repartiment.StateAssigned], repartiment.StatePending: sum[repartiment.StatePending],
		repartiment.StateRejected: sum[repartiment.StateRejected], "dlq_esquema": len(schema), "alertes": alerts,
		repartiment.StateCancelled: comp.Released,
	}
	wantUncovered, wantLegacy := 0, 0
	for _, p := range plan {
		if _, ok := sub.accepted[p.order.ID]; !ok {
			continue
		}
		if p.withdrawn {
			wantUncovered++
		}
		if p.legacy {
			wantLegacy++
		}
	}
	paid := 0
	for _, o := range orders {
		if o[0] == "pagada" {
			paid++
		}
	}
	a, pend, rej := sum[repartiment.StateAssigned], sum[repartiment.StatePending], sum[repartiment.StateRejected]
	// A rejected order is cancelled by its compensation: no longer pagada.
	r.check("every paid order handled by repartiment: assigned, pending or dead-lettered esquema", a+pend+len(schema) == paid,
		"%d paid = %d assigned + %d pending + %d esquema (%d rejected, then cancelled)", paid, a, pend, len(schema), rej)
	// Rejected by repartiment when WithdrawnCity was withdrawn: those still
	// pendent by SetCovered (no letter), those paid later by the handler
	// (letter ciutat_no_coberta, final: it blocks no key).
	blocked, err := countOf(ctx, rp, `SELECT count(*) FROM claus_bloquejades b JOIN lliuraments l ON b.clau = convert_to(l.comanda_id, 'UTF8')
		WHERE b.consumidor = '`+repartiment.ConsumerAssign+`' AND l.estat = 'rebutjat'`)
	if err != nil {
		return err
	}
	lettersOK := len(notCovered) <= rej
	for id := range notCovered {
		if p := byID(plan, id); p == nil || !p.withdrawn {
			lettersOK = false
		}
	}
	r.check("uncovered cities handled: refused at creation with 422 ciutat_no_coberta; withdrawn after acceptance, one repartiment.rebutjat each and no key blocked",
		sub.NotCovered == wantRefusedUncovered(plan) && rej == wantUncovered && rejectedEv == rej && lettersOK && blocked == 0,
		"%d orders to %s refused with 422 (of %d planned); %d accepted orders to %s: %d rejected, %d repartiment.rebutjat, %d dead letters ciutat_no_coberta, %d keys blocked",
		sub.NotCovered, UncoveredCity, wantRefusedUncovered(plan), wantUncovered, WithdrawnCity, rej, rejectedEv, len(notCovered), blocked)
	r.check("versio 1 orders without an address dead-lettered and alerted: motiu esquema, a row in alertes", len(schema) == wantLegacy && alerts >= wantLegacy,
		"%d orders without an address, %d dead-lettered esquema, %d alerts", wantLegacy, len(schema), alerts)
	r.check("couriers assigned once: no delivery left pending", assignedEv == a+comp.Released && pend == 0,
		"%d assigned + %d released by a cancellation, %d repartiment.assignat events, %d pending", a, comp.Released, assignedEv, pend)
	return nil
}

// Names of the invariants the tests look for.
const (
	onlyCheeseInvariant = "only the aged cheese runs out: its later orders dead-lettered estoc_insuficient"
	catalogInvariant    = "cataleg agrees with inventari: estoc_baix = units < 5"
	stockInvariant      = "stock exact: final = initial + restocked − accepted"
	injectedInvariant   = "injected failures recovered from: relay, consumer and charge crashes"
)

// Keys of Report.Injected.
const (
	injectedRelay    = "relay"
	injectedConsumer = "consumer"
	injectedCharge   = "charge"
)

// Print writes the report as text: aligned tables, then the invariants and
// the verdict.
func (r *Report) Print(w io.Writer) {
	fmt.Fprintf(w, "\nkm0 demo · reconciliation report (run %s, %.1f s)\n", r.Run, r.Elapsed)
	fmt.Fprintf(w, "PostgreSQL: %s · events: %s · request/reply: %s\n\n", r.Database, cmp.Or(r.EventsBroker, "Kafka"), r.RequestReply)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	writeOrders(w, tw, r.Orders)
	writeEvents(w, tw, r.Events)
	fmt.Fprintln(tw, "Consumer\tprocessed\tduplicates absorbed\tignored\tretries\tdead letters\trestarts")
	for _, g := range sortedKeys(r.Consumers) {
		c := r.Consumers[g]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\n", g, c.Processed, c.Duplicates, c.Ignored+c.Foreign, c.Retried, c.DeadLettered, c.Restarts)
	}
	tw.Flush()
	fmt.Fprintln(w)
	writeDLQAndStock(w, tw, r.DLQ, r.Stock, "accepted")
	p := r.Payments
	fmt.Fprintln(w)
	writeRows(w, tw, "Payments", [][2]any{
		{"orders paid", p.OrdersPaid}, {"payment records", p.Payments}, {"gateway charges", p.GatewayCharges},
		{"charged twice", p.ChargedTwice}, {"gateway 503 errors", p.GatewayFailures}, {"gateway hangs", p.GatewayHangs},
		{"answers replayed by Idempotency-Key", p.GatewayReplays},
	})
	d := r.Deliveries
	writeRows(w, tw, "Deliveries", [][2]any{
		{"assigned", d[repartiment.StateAssigned]}, {"pending", d[repartiment.StatePending]},
		{"rejected (city not covered)", d[repartiment.StateRejected]}, {"dead-lettered esquema", d["dlq_esquema"]}, {"alerts", d["alertes"]},
	})
	if c := r.Compensation; c != nil {
		c.write(w, tw)
	}
	if a := r.Analytics; a != nil {
		fmt.Fprintln(w, "Analytics (analitica, at most once):")
		writeCounts(w, tw, "  per tipus", "events", a.PerType)
		writeCounts(w, tw, "  per market", "orders", a.PerMarket)
		writeCounts(w, tw, "  cancellations per motiu", "orders", a.PerCancelReason)
	}
	if k := r.KafkaOutage; k != nil {
		fmt.Fprintf(w, "Kafka down %.0f s (inventari reads from %s): %d stock events written during the outage · pending when it came back: inventari's outbox %d, comandes' %d\n\n",
			k.Seconds, brokerName(k.InventariReads), k.StockEvents, k.InventariPending, k.ComandesPending)
	}
	writeCounts(w, tw, "Restarts (injected failures)", "restarts", r.Restarts)
	writeInvariants(w, r.Invariants)
	fmt.Fprintf(w, "\n%s\n", verdict(r.Invariants))
}

// writeOrders writes what the HTTP clients sent and got.
func writeOrders(w io.Writer, tw *tabwriter.Writer, o Submissions) {
	writeRows(w, tw, "Orders", [][2]any{
		{"planned", o.Planned}, {"HTTP requests", o.Requests}, {"accepted (201)", o.Accepted},
		{"duplicates absorbed (Idempotency-Key)", o.Replayed}, {"refused by validation (400)", o.Invalid},
		{"city not covered (422)", o.NotCovered}, {"payment refused (402)", o.Refused}, {"answers 503, retried", o.Unavailable},
		{"cancelled by the client (200)", o.Cancelled}, {"without an answer", o.Unanswered},
	})
}

// writeEvents writes each topic against its service's outbox.
func writeEvents(w io.Writer, tw *tabwriter.Writer, events map[string]TopicCount) {
	fmt.Fprintln(tw, "Topic\toutbox rows\tpending\trecords\tdistinct ids\trepublished\tlost")
	for _, t := range sortedKeys(events) {
		c := events[t]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\n", t, c.OutboxRows, c.Pending, c.Records, c.Distinct, c.Republished, c.Missing)
	}
	tw.Flush()
	fmt.Fprintln(w)
}

// writeRows writes a titled two-column table of labels and figures.
func writeRows(w io.Writer, tw *tabwriter.Writer, title string, rows [][2]any) {
	fmt.Fprintf(w, "%s:\n", title)
	for _, row := range rows {
		fmt.Fprintf(tw, "  %v\t%v\n", row[0], row[1])
	}
	tw.Flush()
	fmt.Fprintln(w)
}

// writeCounts writes a map of counts as a table sorted by key ("none" when
// empty): never a printed Go map.
func writeCounts[N int | int64](w io.Writer, tw *tabwriter.Writer, title, unit string, m map[string]N) {
	if len(m) == 0 {
		fmt.Fprintf(w, "%s: none\n\n", title)
		return
	}
	fmt.Fprintf(tw, "%s\t%s\n", title, unit)
	for _, k := range sortedKeys(m) {
		fmt.Fprintf(tw, "  %s\t%d\n", k, m[k])
	}
	tw.Flush()
	fmt.Fprintln(w)
}

// writeInvariants writes one line per invariant, OK or FAIL.
func writeInvariants(w io.Writer, invs []Invariant) {
	fmt.Fprintln(w, "Invariants:")
	for _, inv := range invs {
		mark := "OK  "
		if !inv.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "  [%s] %s: %s\n", mark, inv.Name, inv.Detail)
	}
}

// listOr joins items with ", ", or says none.
func listOr(items []string, none string) string {
	if len(items) == 0 {
		return none
	}
	return strings.Join(items, ", ")
}

// countsText writes counts as "k1 3, k2 5" in key order ("none" when empty).
func countsText[N int | int64](m map[string]N) string {
	parts := make([]string, 0, len(m))
	for _, k := range sortedKeys(m) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return listOr(parts, "none")
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// writeDLQAndStock writes the dead letters per consumer group and motiu, then
// the stock per product; taken names the column of what orders took from
// stock.
func writeDLQAndStock(w io.Writer, tw *tabwriter.Writer, dlq map[string]int, stock map[string]StockLine, taken string) {
	writeCounts(w, tw, "Dead letters (consumer group · motiu)", "events", dlq)
	fmt.Fprintln(tw, "Product\tinitial\t+ restocked\t− "+taken+"\t= expected\tfinal\tcataleg\tlow stock")
	for _, p := range sortedKeys(stock) {
		s := stock[p]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", p, s.Initial, s.Restocked, s.Accepted, s.Expected, s.Final, s.Catalog, yesNo(s.LowStock))
	}
	tw.Flush()
}

// doubleDecrements counts the (order, product) pairs inventari took from
// stock more than once, from its own estoc.actualitzat events.
func doubleDecrements(ctx context.Context, inv *pgxpool.Pool) (int, error) {
	return countOf(ctx, inv, `SELECT count(*) FROM (SELECT 1 FROM outbox WHERE tipus = 'estoc.actualitzat' AND carrega->>'motiu' = 'comanda'
		GROUP BY carrega->>'comanda_id', carrega->>'producte' HAVING count(*) > 1) d`)
}

// acceptedCheeseOrders counts the accepted orders of the plan that ask for
// the cheese that runs out.
func acceptedCheeseOrders(plan []*planned, sub Submissions) int {
	n := 0
	for _, p := range plan {
		if _, ok := sub.accepted[p.order.ID]; ok && p.cheese {
			n++
		}
	}
	return n
}

// checkCancellations: the client's cancellations answered 200 (the repeat
// the same body), and every cancelled order, the client's and those the
// compensation cancelled for lack of stock, is compensated: stock given
// back, charge refunded once (or never made), courier released.
func (r *Report) checkCancellations(plan []*planned, sub Submissions, refused map[string]bool, c *Compensation) {
	planned, inRetry, late := 0, 0, 0
	for _, p := range plan {
		if _, ok := sub.accepted[p.order.ID]; ok && (p.cancel || p.late) {
			planned++
			if p.cancel && gatewayFails(p.num, 1) {
				inRetry++
			}
			if p.late {
				late++
			}
		}
	}
	r.check("client cancellations answered 200: a repeat answers the same", sub.Cancelled == planned && sub.CancelDiffers == 0 && c.ByReason[comandes.ReasonClient] == planned && inRetry > 0 && c.Released >= late,
		"%d planned (%d right after the 201, %d of them with a failed first charge: cancelled while the charge waited for its retry; %d already paid and assigned: %d couriers released), %d answers 200 ×2, %d repeats that differ, %d orders cancelled by the client",
		planned, planned-late, inRetry, late, c.Released, sub.Cancelled, sub.CancelDiffers, c.ByReason[comandes.ReasonClient])
	r.check("orders refused for stock cancelled and refunded: motiu estoc_insuficient", c.RefusedNotCancelled == 0 && c.ByReason[inventari.ErrInsufficient.Error()] == len(refused),
		"%d refused for stock, %d cancelled for estoc_insuficient, %d not cancelled", len(refused), c.ByReason[inventari.ErrInsufficient.Error()], c.RefusedNotCancelled)
	r.check("no order rejected by repartiment stays charged: each cancelled (ciutat_no_coberta) and refunded once, or never charged",
		c.RejectedNotCancelled == 0 && c.RejectedCharged == 0 && c.ByReason[comandes.ReasonNotCovered] == c.Rejected,
		"%d rejected, %d cancelled for ciutat_no_coberta, %d not cancelled, %d left charged",
		c.Rejected, c.ByReason[comandes.ReasonNotCovered], c.RejectedNotCancelled, c.RejectedCharged)
	r.check("cancelled orders compensated: stock given back, refunded once, courier released", c.ok(), "%s", c)
}

// wantRefusedUncovered counts the orders to UncoveredCity that reach the
// coverage check (a 400 for bad input comes first).
func wantRefusedUncovered(plan []*planned) int {
	n := 0
	for _, p := range plan {
		if p.uncovered && !p.invalid {
			n++
		}
	}
	return n
}

// byID returns the planned order id, or nil.
func byID(plan []*planned, id string) *planned {
	for _, p := range plan {
		if p.order.ID == id {
			return p
		}
	}
	return nil
}

// brokerName is the display name of a system.Events broker.
func brokerName(b string) string {
	if b == system.EventsRabbitMQ {
		return "RabbitMQ"
	}
	return "Kafka"
}
