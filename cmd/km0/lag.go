package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/lag"
)

func init() {
	register(&command{name: "lag", summary: "outbox pending rows, consumer-group lag per partition and RabbitMQ queue depth; exit 1 over a threshold (or --serve them as metrics)", run: runLag})
}

// errOverThreshold makes km0 lag exit 1 after printing the table.
var errOverThreshold = errors.New("over threshold")

func runLag(ctx context.Context, args []string) error {
	return lagCmd(ctx, os.Stdout, os.Stderr, args)
}

func lagCmd(ctx context.Context, out, errOut io.Writer, args []string) error {
	fs := cli.NewFlags("lag", "measure each outbox's pending rows and oldest age, each Kafka consumer group's lag per partition and the age of its oldest unprocessed record, and RabbitMQ ready/unacked messages per queue")
	fs.SetOutput(errOut)
	brokers := cli.BrokersFlag(fs)
	ksec := cli.KafkaSecurityFlags(fs)
	amqpURL := cli.SecretString(fs, "amqp-url", os.Getenv("KM0_AMQP_URL"), "RabbitMQ URL of --queue (default $KM0_AMQP_URL, else the local guest broker)")
	amqpTLS := cli.AddAMQPTLSFlags(fs)
	queues := &cli.ListFlag{}
	fs.Var(queues, "queue", "a RabbitMQ queue to report, with its .dlq; the logical queue of an ordered consumer reports its shard queues <queue>.<i> (repeatable or comma separated)")
	asJSON := fs.Bool("json", false, "print the snapshot as JSON")
	partitions := fs.Bool("partitions", false, "one line per partition of each consumer group (default: one line per group)")
	serve := fs.String("serve", "", "instead of printing once: sample every --lag-interval and serve Prometheus metrics at http://ADDR/metrics")
	webhook := cli.SecretString(fs, "webhook", os.Getenv("KM0_DLQ_WEBHOOK"), "with --serve: URL that gets a JSON notice when a threshold is exceeded for --alert-for (default $KM0_DLQ_WEBHOOK)")
	lf := addLagFlags(fs, true)
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	var qs []string
	for _, q := range *queues {
		qs = append(qs, splitList(q)...)
	}
	cfg, closeLag, err := lagConfig(ctx, *brokers, *amqpURL, amqpTLS, qs, kafkadlq.GroupDefault, lf)
	if err != nil {
		return err
	}
	defer closeLag()
	if len(cfg.Brokers) > 0 {
		if cfg.ClientOpts, err = ksec.Opts(ctx, cfg.Brokers, cfg.Logger); err != nil {
			return err
		}
	}
	if len(cfg.Outboxes) == 0 && len(cfg.Brokers) == 0 && len(cfg.Queues) == 0 {
		return errors.New("nothing to measure: give --outbox, --brokers (or $KM0_KAFKA_BROKERS) or --queue")
	}
	rule := lf.rule()
	m, err := cfg.Measurer()
	if err != nil {
		return err
	}
	defer m.Close()
	if *serve != "" {
		return serveLag(ctx, m, *serve, *webhook, rule, *lf.interval, errOut)
	}
	snap, err := m.Measure(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(snap); err != nil {
			return err
		}
	} else {
		printLag(out, snap, *partitions)
	}
	over := overThreshold(snap, rule)
	for _, o := range over {
		fmt.Fprintf(errOut, "km0 lag: over threshold: %s\n", o)
	}
	switch {
	case len(over) > 0:
		return fmt.Errorf("%w: %d", errOverThreshold, len(over))
	case len(snap.Errors) > 0:
		return fmt.Errorf("%d part(s) could not be measured: %s", len(snap.Errors), strings.Join(snap.Errors, "; "))
	}
	return nil
}

// overThreshold names what exceeds rule now (no duration: a one-shot check).
func overThreshold(s *lag.Snapshot, r lag.Rule) []string {
	var out []string
	over := func(obj string, n int64, age float64, hasAge bool) {
		lagOver, ageOver := r.Over(n, age, hasAge)
		if lagOver {
			out = append(out, fmt.Sprintf("%s: lag %d > %d", obj, n, r.MaxLag))
		}
		if ageOver {
			out = append(out, fmt.Sprintf("%s: oldest %s > %s", obj, time.Duration(age*float64(time.Second)).Round(time.Second), r.MaxAge))
		}
	}
	for _, o := range s.Outboxes {
		over("outbox "+o.Name, o.Pending, o.OldestSeconds, true)
	}
	for _, g := range s.Groups {
		over("group "+g.Group, g.Total, g.OldestSeconds, true)
	}
	for _, q := range s.Queues {
		over("queue "+q.Queue, int64(q.Ready), 0, false)
	}
	return out
}

// printLag prints s as aligned tables: one line per outbox, per consumer
// group (its total lag and oldest age; with partitions, a line per
// partition first, the caught-up partitions of a .retry topic folded into
// one) and per queue, then the notes.
func printLag(w io.Writer, s *lag.Snapshot, partitions bool) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	age := func(secs float64) string {
		if secs <= 0 {
			return "-"
		}
		return time.Duration(secs * float64(time.Second)).Round(time.Second).String()
	}
	if len(s.Outboxes) > 0 && !slices.ContainsFunc(s.Outboxes, func(o lag.OutboxLag) bool { return o.WAL != nil }) {
		fmt.Fprintln(tw, "OUTBOX\tPENDING\tOLDEST")
		for _, o := range s.Outboxes {
			if o.Err != "" {
				fmt.Fprintf(tw, "%s\terror: %s\n", o.Name, o.Err)
				continue
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\n", o.Name, o.Pending, age(o.OldestSeconds))
		}
		fmt.Fprintln(tw)
	} else if len(s.Outboxes) > 0 {
		// With a WAL-mode outbox: its pending events are its slot's
		// unconfirmed bytes, and the slot's retained WAL and status follow.
		// A table outbox has no slot ("-"); the outboxes that could not be
		// measured come last, so that their rows do not break the columns.
		fmt.Fprintln(tw, "OUTBOX\tMODE\tPENDING\tOLDEST\tSLOT\tRETAINED\tSTATUS")
		var failed []lag.OutboxLag
		for _, o := range s.Outboxes {
			switch {
			case o.WAL == nil && o.Err != "":
				failed = append(failed, o)
			case o.WAL == nil:
				fmt.Fprintf(tw, "%s\ttable\t%d\t%s\t-\t-\t-\n", o.Name, o.Pending, age(o.OldestSeconds))
			default:
				w := o.WAL
				oldest := age(o.OldestSeconds)
				if !w.OldestKnown {
					oldest = "?"
				}
				status := w.WALStatus + ", no relay"
				if w.Active {
					status = w.WALStatus + ", streaming"
				}
				if o.Err != "" {
					status += ", error: " + o.Err
				}
				fmt.Fprintf(tw, "%s\twal\t%s\t%s\t%s\t%s\t%s\n", o.Name, bytesText(w.LagBytes), oldest, w.Slot, bytesText(w.RetainedBytes), status)
			}
		}
		for _, o := range failed {
			fmt.Fprintf(tw, "%s\terror: %s\n", o.Name, o.Err)
		}
		fmt.Fprintln(tw)
	}
	if len(s.Groups) > 0 && !partitions {
		fmt.Fprintln(tw, "GROUP\tSTATE\tMEMBERS\tPARTITIONS\tLAG\tOLDEST")
		for _, g := range s.Groups {
			if g.Err != "" {
				fmt.Fprintf(tw, "%s\terror: %s\n", g.Group, g.Err)
				continue
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%s\n", g.Group, g.State, g.Members, len(g.Partitions), g.Total, age(g.OldestSeconds))
		}
		fmt.Fprintln(tw)
	}
	if len(s.Groups) > 0 && partitions {
		fmt.Fprintln(tw, "GROUP\tTOPIC\tPARTITION\tCOMMITTED\tEND\tLAG\tOLDEST")
		for _, g := range s.Groups {
			if g.Err != "" {
				fmt.Fprintf(tw, "%s\terror: %s\n", g.Group, g.Err)
				continue
			}
			folded := map[string]int{} // .retry topic → its caught-up partitions
			for _, p := range g.Partitions {
				if p.Lag == 0 && strings.HasSuffix(p.Topic, contract.RetrySuffix) {
					folded[p.Topic]++
					continue
				}
				committed := "-"
				if p.Committed >= 0 {
					committed = strconv.FormatInt(p.Committed, 10)
				}
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\t%d\t%s\n", g.Group, p.Topic, p.Partition, committed, p.End, p.Lag, age(p.OldestSeconds))
			}
			for _, t := range slices.Sorted(maps.Keys(folded)) {
				fmt.Fprintf(tw, "%s\t%s\t%s\t\t\t0\t-\n", g.Group, t, plural(folded[t], "partition"))
			}
			fmt.Fprintf(tw, "%s\ttotal (%s, %s)\t\t\t\t%d\t%s\n", g.Group, g.State, plural(g.Members, "member"), g.Total, age(g.OldestSeconds))
		}
		fmt.Fprintln(tw)
	}
	if len(s.Queues) > 0 {
		fmt.Fprintln(tw, "QUEUE\tREADY\tUNACKED\tCONSUMERS")
		for _, q := range s.Queues {
			if q.Err != "" {
				fmt.Fprintf(tw, "%s\terror: %s\n", q.Queue, q.Err)
				continue
			}
			unacked := "-"
			if q.Unacked >= 0 {
				unacked = strconv.Itoa(q.Unacked)
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%d\n", q.Queue, q.Ready, unacked, q.Consumers)
		}
	}
	_ = tw.Flush()
	for _, n := range s.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
}

// bytesText is n bytes for people: 592 B, 12.5 KiB, 3.0 MiB.
func bytesText(n int64) string {
	if n < 1024 {
		return strconv.FormatInt(n, 10) + " B"
	}
	f, unit := float64(n)/1024, "KiB"
	for _, u := range []string{"MiB", "GiB", "TiB"} {
		if f < 1024 {
			break
		}
		f, unit = f/1024, u
	}
	return strconv.FormatFloat(f, 'f', 1, 64) + " " + unit
}

// plural is "1 partition", "3 partitions".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}

// serveLag is km0 lag --serve: the lag exporter, and the lag alerts.
func serveLag(ctx context.Context, m *lag.Measurer, addr, webhook string, rule lag.Rule, interval time.Duration, errOut io.Writer) error {
	reg := prometheus.NewRegistry()
	var watch *lag.Watch
	if webhook != "" && rule.On() {
		al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, Logger: cli.Logger(), WebhookURL: webhook})
		if err != nil {
			return err
		}
		defer func() {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
			defer cancel()
			_ = al.Close(cctx)
		}()
		watch = lag.NewWatch(rule, al)
	}
	s := lag.NewSampler(lag.SamplerConfig{Measurer: m, Interval: interval, Watch: watch, Logger: cli.Logger()})
	if err := reg.Register(lag.Collector{S: s, AllGroups: rule.AllGroups}); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("--serve: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	fmt.Fprintf(errOut, "km0 lag: metrics at http://%s/metrics, sampled every %s\n", ln.Addr(), interval)
	return s.Run(ctx)
}
