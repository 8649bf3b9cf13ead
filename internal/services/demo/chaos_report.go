package demo

import (
	"fmt"
	"io"
	"sort"
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

// Print writes the report as text: aligned tables, then the invariants and
// the verdict.
func (r *ChaosReport) Print(w io.Writer) {
	ks, kb := r.Kills()
	fmt.Fprintf(w, "\nkm0 demo --chaos · report (seed %d, run %s, %.1f s)\n", r.Seed, r.Run, r.Elapsed)
	fmt.Fprintf(w, "PostgreSQL: %s · request/reply: %s · logs: %s\n", r.Database, r.RequestReply, r.Dir)
	fmt.Fprintf(w, "Faults: %d SIGKILLs of services, %d of the broker; last fault at %.1f s, last answer at %.1f s\n", ks, kb, r.LastFault, r.DriveEnd)
	if r.Settled {
		fmt.Fprintf(w, "Time to settle: %.1f s after the last fault\n\n", r.SettleFault)
	} else {
		fmt.Fprintf(w, "NOT settled (%.1f s after the last fault)\n", r.SettleFault)
		for _, s := range r.Stuck {
			fmt.Fprintf(w, "  stuck: %s\n", s)
		}
		fmt.Fprintln(w)
	}
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "Fault\tstart (s)\tend (s)\terror")
	for _, f := range r.Done {
		if f.Kind == FaultPoison {
			continue
		}
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%s\n", f.Fault, f.Start, f.End, f.Err)
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(tw, "Process\tstarts\tSIGKILLs\town exits\tstop (s)")
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
	fmt.Fprintln(w)
	writeOrders(w, tw, r.Orders)
	writeEvents(w, tw, r.Events)
	writeDLQAndStock(w, tw, r.DLQ, r.Stock, "applied")
	p := r.Payments
	fmt.Fprintln(w)
	writeRows(w, tw, "Payments", [][2]any{
		{"orders paid", p.OrdersPaid}, {"payment records", p.Payments}, {"gateway charges", p.GatewayCharges},
		{"surplus charges", p.ChargedTwice}, {"repeated gateway calls absorbed", p.GatewayReplays},
	})
	d := r.Deliveries
	writeRows(w, tw, "Deliveries", [][2]any{
		{"assigned", d["assignat"]}, {"pending", d["pendent"]}, {"rejected (city not covered)", d["rebutjat"]}, {"dead-lettered esquema", d["dlq_esquema"]},
	})
	if c := r.Compensation; c != nil {
		c.write(w, tw)
	}
	fmt.Fprintln(tw, "Poison record\ttopic/partition@offset\tbytes\tresult")
	for _, v := range r.Poison {
		mark := "OK"
		if !v.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(tw, "%s\t%s/%d@%d\t%d\t%s %s\n", v.Name, v.Topic, v.Partition, v.Offset, v.Bytes, mark, mapText(v.Groups))
	}
	tw.Flush()
	fmt.Fprintln(w)
	writeInvariants(w, r.Invariants)
	if r.OK {
		fmt.Fprintf(w, "\n%s Settled %.1f s after the last fault.\n", verdict(r.Invariants), r.SettleFault)
	} else {
		fmt.Fprintf(w, "\n%s\n", verdict(r.Invariants))
	}
}
