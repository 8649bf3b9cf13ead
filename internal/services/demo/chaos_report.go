package demo

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
)

// Kills returns the SIGKILLs of services and of the broker that ran.
func (r *ChaosReport) Kills() (services, broker int) {
	for _, f := range r.Done {
		if f.Err != "" {
			continue
		}
		switch f.Kind {
		case FaultKill:
			services++
		case FaultBroker:
			broker++
		}
	}
	return services, broker
}

// Print writes the report as text.
func (r *ChaosReport) Print(w io.Writer) {
	ks, kb := r.Kills()
	fmt.Fprintf(w, "\nkm0 demo --chaos · informe (llavor %d, execució %s, %.1f s)\n", r.Seed, r.Run, r.Elapsed)
	fmt.Fprintf(w, "PostgreSQL: %s · petició/resposta: %s · registres: %s\n", r.Database, r.RequestReply, r.Dir)
	fmt.Fprintf(w, "Fallades: %d SIGKILL de serveis, %d del broker; darrera fallada als %.1f s, darrera resposta als %.1f s\n", ks, kb, r.LastFault, r.DriveEnd)
	if r.Settled {
		fmt.Fprintf(w, "Temps fins a assentar-se: %.1f s després de la darrera fallada\n\n", r.SettleFault)
	} else {
		fmt.Fprintf(w, "NO s'ha assentat (%.1f s després de la darrera fallada)\n", r.SettleFault)
		for _, s := range r.Stuck {
			fmt.Fprintf(w, "  encallat: %s\n", s)
		}
		fmt.Fprintln(w)
	}
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "Fallada\tinici (s)\tfi (s)\terror")
	for _, f := range r.Done {
		if f.Kind == FaultPoison {
			continue
		}
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%s\n", f.Fault, f.Start, f.End, f.Err)
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(tw, "Procés\tarrencades\tSIGKILL\tsortides pròpies\taturada (s)")
	names := make([]string, 0, len(r.Processes))
	for n := range r.Processes {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		p := r.Processes[n]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.1f\n", n, p.Starts, p.Kills, p.Crashes, r.StopSecs[n])
	}
	tw.Flush()
	o := r.Orders
	fmt.Fprintf(w, "\nComandes: %d planejades, %d peticions HTTP · %d acceptades · %d duplicats absorbits · %d rebutjades (400) · %d refusades (402) · %d respostes 503 reintentades · %d sense resposta\n\n",
		o.Planned, o.Requests, o.Accepted, o.Replayed, o.Invalid, o.Refused, o.Unavailable, o.Unanswered)
	fmt.Fprintln(tw, "Esdeveniments\tfiles outbox\tpendents\tregistres\tids diferents\trepublicats\tperduts")
	for _, t := range sortedKeys(r.Events) {
		c := r.Events[t]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\n", t, c.OutboxRows, c.Pending, c.Records, c.Distinct, c.Republished, c.Missing)
	}
	tw.Flush()
	fmt.Fprintln(w)
	writeDLQAndStock(w, tw, r.DLQ, r.Stock, "aplicat")
	p := r.Payments
	fmt.Fprintf(w, "\nPagaments: %d comandes pagades · %d pagaments · %d cobraments a la passarel·la · %d sobrers · %d crides repetides absorbides\n",
		p.OrdersPaid, p.Payments, p.GatewayCharges, p.ChargedTwice, p.GatewayReplays)
	d := r.Deliveries
	fmt.Fprintf(w, "Lliuraments: %d assignats · %d pendents · %d rebutjats (ciutat no coberta) · %d a la DLQ d'esquema\n\n",
		d["assignat"], d["pendent"], d["rebutjat"], d["dlq_esquema"])
	fmt.Fprintln(tw, "Verinós\ttopic/partició@offset\tbytes\tresultat")
	for _, v := range r.Poison {
		var gs []string
		for _, g := range sortedKeys(v.Groups) {
			gs = append(gs, g+": "+v.Groups[g])
		}
		mark := "OK"
		if !v.OK {
			mark = "FALLA"
		}
		fmt.Fprintf(tw, "%s\t%s/%d@%d\t%d\t%s %s\n", v.Name, v.Topic, v.Partition, v.Offset, v.Bytes, mark, strings.Join(gs, "; "))
	}
	tw.Flush()
	fmt.Fprintln(w, "\nInvariants:")
	for _, inv := range r.Invariants {
		mark := "OK   "
		if !inv.OK {
			mark = "FALLA"
		}
		fmt.Fprintf(w, "  [%s] %s: %s\n", mark, inv.Name, inv.Detail)
	}
	if r.OK {
		fmt.Fprintf(w, "\nTot quadra: %d invariants de %d; assentat %.1f s després de la darrera fallada.\n", len(r.Invariants), len(r.Invariants), r.SettleFault)
	} else {
		fmt.Fprintf(w, "\nNO QUADRA: %s\n", strings.Join(r.Failed(), "; "))
	}
}
