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
	Run          string                   `json:"execucio"`
	Database     string                   `json:"base_de_dades"`
	RequestReply string                   `json:"peticio_resposta"`
	EventsBroker string                   `json:"broker_esdeveniments"` // Kafka, RabbitMQ, or Kafka with some topics on RabbitMQ
	Elapsed      float64                  `json:"segons"`
	Orders       Submissions              `json:"comandes"`
	Events       map[string]TopicCount    `json:"esdeveniments"`
	Consumers    map[string]ConsumerCount `json:"consumidors"`
	DLQ          map[string]int           `json:"dlq_per_motiu"` // distinct events (a crash before the offset commit dead-letters one again)
	Stock        map[string]StockLine     `json:"estoc"`
	Payments     PaymentSummary           `json:"pagaments"`
	Deliveries   map[string]int           `json:"lliuraments"`
	Analytics    *analitica.Counters      `json:"analitica,omitempty"`
	Compensation *Compensation            `json:"compensacio,omitempty"`
	Restarts     map[string]int           `json:"reinicis"`
	Injected     map[string]bool          `json:"fallades_injectades"` // which injected failures fired (relay, consumidor, cobrament)
	KafkaOutage  *KafkaOutage             `json:"kafka_caigut,omitempty"`
	Invariants   []Invariant              `json:"invariants"`
	OK           bool                     `json:"ok"`
}

// TopicCount compares a service's outbox with its topic.
type TopicCount struct {
	OutboxRows  int `json:"files_outbox"`
	Pending     int `json:"pendents"`
	Records     int `json:"registres_al_topic"`
	Distinct    int `json:"ids_diferents"`
	Missing     int `json:"perduts"`     // outbox rows whose id never reached the topic
	Republished int `json:"republicats"` // records − distinct: relay re-publications
}

// ConsumerCount is a consumer's counts over the run, restarts included.
type ConsumerCount struct {
	consumer.Stats
	Restarts int `json:"reinicis"`
}

// StockLine reconciles one product.
type StockLine struct {
	Initial   int  `json:"inicial"`
	Restocked int  `json:"reposat"`
	Accepted  int  `json:"acceptat"` // units of orders inventari did not dead-letter
	Expected  int  `json:"esperat"`  // inicial + reposat − acceptat
	Final     int  `json:"final"`
	Catalog   int  `json:"cataleg"`
	LowStock  bool `json:"estoc_baix"`
}

// PaymentSummary reconciles payments with the gateway.
type PaymentSummary struct {
	OrdersPaid      int `json:"comandes_pagades"`
	Payments        int `json:"pagaments"`
	GatewayCharges  int `json:"cobraments_passarella"`
	ChargedTwice    int `json:"cobrats_dues_vegades"`
	WrongAmount     int `json:"import_incorrecte"`
	Unpaid          int `json:"acceptades_sense_pagar"`
	GatewayFailures int `json:"passarella_503"`
	GatewayHangs    int `json:"passarella_penjada"`
	GatewayReplays  int `json:"passarella_repeticions"`
}

// Invariant is one check of the report.
type Invariant struct {
	Name   string `json:"nom"`
	OK     bool   `json:"ok"`
	Detail string `json:"detall"`
}

func (r *Report) check(name string, ok bool, format string, args ...any) {
	r.Invariants = append(r.Invariants, Invariant{Name: name, OK: ok, Detail: fmt.Sprintf(format, args...)})
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
	r.check("comandes acceptades = comandes desades", len(orders) == sub.Accepted && missing == 0,
		"%d respostes 201, %d comandes a km0_comandes, %d acceptades sense fila", sub.Accepted, len(orders), missing)
	r.check("Idempotency-Key: cap duplicat crea res", sub.ReplayDiffers == 0 && sub.Unexpected == 0 && sub.Other == 0,
		"%d repeticions respostes amb la primera resposta, %d amb una altra, %d respostes inesperades", sub.Replayed, sub.ReplayDiffers, sub.Unexpected+sub.Other)

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
		r.check("cap esdeveniment perdut: "+topic, tc.Pending == 0 && tc.Missing == 0 && tc.Distinct == tc.OutboxRows,
			"%d files d'outbox, %d pendents, %d registres (%d ids diferents, %d republicats), %d perduts",
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
		"%d events counted of %d written (%d lost, at most once); counted more than written: %v", counted, total, lost, over)
	return nil
}

// checkInjectedFailures checks that every injected failure fired and was
// recovered from: the relay and inventari's consumer were restarted, the
// consumer's redelivered batch was absorbed as duplicates, and the charge
// that died between the gateway and COMMIT fired (it leaves no restart: the
// retry absorbs it, so the hook itself says whether it fired).
func (r *Report) checkInjectedFailures(duplicates int64) {
	relay, cons := r.Restarts["relay "+comandes.Name], r.Restarts["consumer "+inventari.ConsumerDecrement]
	r.check("fallades injectades i recuperades", relay >= 1 && cons >= 1 && r.Injected["cobrament"] && duplicates > 0,
		"relay de comandes reiniciat %d cop(s), consumidor %s reiniciat %d cop(s), %d duplicats absorbits, mort entre passarel·la i COMMIT: %v",
		relay, inventari.ConsumerDecrement, cons, duplicates, r.Injected["cobrament"])
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
	r.check("estoc final = inicial + reposat − acceptat", stockOK, "productes que no quadren: %v", bad)
	doubled, err := doubleDecrements(ctx, ip)
	if err != nil {
		return err
	}
	r.check("cap comanda descomptada dues vegades", doubled == 0, "%d parells (comanda, producte) descomptats més d'un cop", doubled)
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
	r.check("només el formatge curat s'esgota, i va a la DLQ", onlyCheese && len(insufficient) == cheeseAccepted-served && took[Cheese] == served*CheesePerOrder,
		"%d comandes amb formatge curat, %d servides (%d unitats de %d; se n'esperaven %d), %d a la DLQ per estoc_insuficient",
		cheeseAccepted, took[Cheese]/CheesePerOrder, took[Cheese], inventari.InitialStock[Cheese], served, len(insufficient))
	if sys.Cataleg != nil {
		r.check("cataleg coincideix amb inventari (estoc_baix = unitats < 5)", catalogOK, "indicador de %d productes (%d amb estoc canviat)", len(flags), len(changed))
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
	r.check("cada comanda pagada cobrada exactament una vegada a la passarel·la",
		ps.Payments == sub.Accepted-comp.NeverCharged-comp.ChargedUnbooked && ps.GatewayCharges == ps.Payments+comp.ChargedUnbooked &&
			ps.OrdersPaid == ps.Payments-(comp.Charged-comp.ChargedUnbooked) && ps.WrongAmount == 0 && ps.ChargedTwice == 0 && ps.Unpaid == 0 && chargeDLQ == 0,
		"%d acceptades (%d cancel·lades abans del cobrament), %d pagaments, %d cobraments a la passarel·la (una clau cobrament-<id> cadascun), %d comandes pagades (%d cobrades i cancel·lades), %d sense pagar, %d imports o referències incorrectes, %d cobraments sense registre; la passarel·la va fallar %d cop(s), es va penjar %d cop(s) i va repetir %d resposta(es)",
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
	r.check("cada comanda pagada: assignada, pendent o a la DLQ d'esquema", a+pend+len(schema) == paid,
		"%d pagades = %d assignades + %d pendents + %d esquema (%d rebutjades, cancel·lades)", paid, a, pend, len(schema), rej)
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
	r.check("uncovered city: refused at creation (422 ciutat_no_coberta); coverage withdrawn after acceptance: rejected once (repartiment.rebutjat), no key blocked",
		sub.NotCovered == wantRefusedUncovered(plan) && rej == wantUncovered && rejectedEv == rej && lettersOK && blocked == 0,
		"%d orders to %s refused with 422 (of %d planned); %d accepted orders to %s: %d rejected, %d repartiment.rebutjat, %d dead letters ciutat_no_coberta, %d keys blocked",
		sub.NotCovered, UncoveredCity, wantRefusedUncovered(plan), wantUncovered, WithdrawnCity, rej, rejectedEv, len(notCovered), blocked)
	r.check("versio 1 sense adreça: DLQ esquema + alerta", len(schema) == wantLegacy && alerts >= wantLegacy,
		"%d comandes sense adreça, %d a la DLQ esquema, %d alertes", wantLegacy, len(schema), alerts)
	r.check("repartidors assignats un cop i cap lliurament pendent", assignedEv == a+comp.Released && pend == 0,
		"%d assignades + %d alliberades per cancel·lació, %d esdeveniments repartiment.assignat, %d pendents", a, comp.Released, assignedEv, pend)
	return nil
}

// Print writes the report as text.
func (r *Report) Print(w io.Writer) {
	fmt.Fprintf(w, "\nkm0 demo · informe de conciliació (execució %s, %.1f s)\n", r.Run, r.Elapsed)
	fmt.Fprintf(w, "PostgreSQL: %s · esdeveniments: %s · petició/resposta: %s\n\n", r.Database, cmp.Or(r.EventsBroker, "Kafka"), r.RequestReply)
	o := r.Orders
	fmt.Fprintf(w, "Comandes: %d planejades, %d peticions HTTP · %d acceptades · %d duplicats absorbits (Idempotency-Key) · %d rebutjades per validació (400) · %d ciutat no coberta (422) · %d pagament refusat (402) · %d respostes 503 reintentades\n\n",
		o.Planned, o.Requests, o.Accepted, o.Replayed, o.Invalid, o.NotCovered, o.Refused, o.Unavailable)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "Esdeveniments\tfiles outbox\tpendents\tregistres\tids diferents\trepublicats\tperduts")
	for _, t := range sortedKeys(r.Events) {
		c := r.Events[t]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\n", t, c.OutboxRows, c.Pending, c.Records, c.Distinct, c.Republished, c.Missing)
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(tw, "Consumidor\tprocessats\tduplicats absorbits\tignorats\treintents\tDLQ\treinicis")
	for _, g := range sortedKeys(r.Consumers) {
		c := r.Consumers[g]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\n", g, c.Processed, c.Duplicates, c.Ignored+c.Foreign, c.Retried, c.DeadLettered, c.Restarts)
	}
	tw.Flush()
	fmt.Fprintln(w)
	writeDLQAndStock(w, tw, r.DLQ, r.Stock, "acceptat")
	p := r.Payments
	fmt.Fprintf(w, "\nPagaments: %d comandes pagades · %d pagaments · %d cobraments a la passarel·la · %d cobrades dues vegades · passarel·la: %d errors 503, %d penjades, %d respostes repetides per Idempotency-Key\n",
		p.OrdersPaid, p.Payments, p.GatewayCharges, p.ChargedTwice, p.GatewayFailures, p.GatewayHangs, p.GatewayReplays)
	d := r.Deliveries
	fmt.Fprintf(w, "Lliuraments: %d assignats · %d pendents · %d rebutjats (ciutat no coberta) · %d a la DLQ d'esquema (%d alertes)\n",
		d[repartiment.StateAssigned], d[repartiment.StatePending], d[repartiment.StateRejected], d["dlq_esquema"], d["alertes"])
	if c := r.Compensation; c != nil {
		fmt.Fprintf(w, "Cancel·lacions: %s\n", c)
	}
	if r.Analytics != nil {
		fmt.Fprintf(w, "Analitica (at-most-once): per tipus %v · per mercat %v · cancel·lacions per motiu %v\n", r.Analytics.PerType, r.Analytics.PerMarket, r.Analytics.PerCancelReason)
	}
	if k := r.KafkaOutage; k != nil {
		fmt.Fprintf(w, "Kafka caigut %.0f s (inventari llegeix de %s): %d esdeveniments d'estoc escrits durant la caiguda · pendents en tornar: outbox d'inventari %d, de comandes %d\n",
			k.Seconds, brokerName(k.InventariReads), k.StockEvents, k.InventariPending, k.ComandesPending)
	}
	fmt.Fprintf(w, "Reinicis (fallades injectades): %v\n\nInvariants:\n", r.Restarts)
	for _, inv := range r.Invariants {
		mark := "OK   "
		if !inv.OK {
			mark = "FALLA"
		}
		fmt.Fprintf(w, "  [%s] %s: %s\n", mark, inv.Name, inv.Detail)
	}
	if r.OK {
		fmt.Fprintf(w, "\nTot quadra: %d invariants de %d.\n", len(r.Invariants), len(r.Invariants))
	} else {
		fmt.Fprintf(w, "\nNO QUADRA: %s\n", strings.Join(r.Failed(), "; "))
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// writeDLQAndStock writes the dead letters per consumidor and motiu, then the
// stock per product; taken names the column of what orders took from stock.
func writeDLQAndStock(w io.Writer, tw *tabwriter.Writer, dlq map[string]int, stock map[string]StockLine, taken string) {
	fmt.Fprintln(tw, "DLQ (consumidor · motiu)\tentrades")
	for _, k := range sortedKeys(dlq) {
		fmt.Fprintf(tw, "%s\t%d\n", k, dlq[k])
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(tw, "Producte\tinicial\t+ reposat\t− "+taken+"\t= esperat\tfinal\tcataleg\testoc baix")
	for _, p := range sortedKeys(stock) {
		s := stock[p]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%v\n", p, s.Initial, s.Restocked, s.Accepted, s.Expected, s.Final, s.Catalog, s.LowStock)
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
	r.check("cancel·lacions del client: 200 i la repetició respon el mateix", sub.Cancelled == planned && sub.CancelDiffers == 0 && c.ByReason[comandes.ReasonClient] == planned && inRetry > 0 && c.Released >= late,
		"%d previstes (%d just després del 201, %d d'elles amb el primer cobrament fallit: cancel·lades amb el cobrament en reintent; %d ja pagades i assignades: %d repartidors alliberats), %d respostes 200 ×2, %d repeticions diferents, %d comandes cancel·lades pel client",
		planned, planned-late, inRetry, late, c.Released, sub.Cancelled, sub.CancelDiffers, c.ByReason[comandes.ReasonClient])
	r.check("refusades per estoc: cancel·lades (estoc_insuficient) i reemborsades", c.RefusedNotCancelled == 0 && c.ByReason[inventari.ErrInsufficient.Error()] == len(refused),
		"%d refusades per estoc, %d cancel·lades per estoc_insuficient, %d sense cancel·lar", len(refused), c.ByReason[inventari.ErrInsufficient.Error()], c.RefusedNotCancelled)
	r.check("no order rejected by repartiment stays charged: each cancelled (ciutat_no_coberta) and refunded once, or never charged",
		c.RejectedNotCancelled == 0 && c.RejectedCharged == 0 && c.ByReason[comandes.ReasonNotCovered] == c.Rejected,
		"%d rejected, %d cancelled for ciutat_no_coberta, %d not cancelled, %d left charged",
		c.Rejected, c.ByReason[comandes.ReasonNotCovered], c.RejectedNotCancelled, c.RejectedCharged)
	r.check("cancel·lades: estoc retornat, reemborsament un cop, repartidor alliberat", c.ok(), "%s", c)
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
