package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/km0/km0/services/demo"
)

func init() {
	register(&command{name: "demo", summary: "run the Quilòmetre Zero system end to end with failures injected and reconcile it (README command 1)", run: runDemo})
}

// errInvariants makes km0 demo exit 1 after printing the failed invariants.
var errInvariants = errors.New("invariants failed")

func runDemo(ctx context.Context, args []string) error {
	fs := newFlags("demo", "start an embedded Kafka, PostgreSQL databases and the six services, drive orders with failures injected, and print a reconciliation report (exit 0 only if every invariant holds)")
	orders := fs.Int("orders", demo.OrdersDefault, "number of orders to submit")
	clients := fs.Int("clients", demo.ClientsDefault, "concurrent HTTP clients")
	keep := fs.Bool("keep-running", false, "leave the services and their HTTP APIs up after the report (Ctrl-C stops them)")
	asJSON := fs.Bool("json", false, "print the report as JSON on stdout (progress goes to stderr)")
	authorize := fs.Bool("authorize", true, "comandes authorises each order with pagaments by request/reply (RabbitMQ if KM0_AMQP_URL is set, else the embedded Kafka)")
	keepDB := fs.Bool("keep-databases", false, "do not drop the run's km0_<service>_demo_<run> databases")
	seed := fs.Uint64("seed", 1, "scenario seed")
	if err := parse(fs, args); err != nil {
		return err
	}
	progress := os.Stdout
	if *asJSON {
		progress = os.Stderr
	}
	var report *demo.Report
	_, err := demo.Run(ctx, demo.Config{
		Orders: *orders, Clients: *clients, AMQPURL: os.Getenv("KM0_AMQP_URL"), NoAuthorize: !*authorize,
		KeepRunning: *keep, KeepDatabases: *keepDB, Seed: *seed, Out: progress, Logger: demoLogger(),
		OnReport: func(r *demo.Report) {
			report = r
			if *asJSON {
				enc := json.NewEncoder(os.Stdout)
				enc.SetIndent("", "  ")
				_ = enc.Encode(r)
				return
			}
			r.Print(os.Stdout)
		},
	})
	if err != nil {
		return err
	}
	if report != nil && !report.OK {
		fmt.Fprintf(os.Stderr, "km0 demo: failed invariants: %s\n", strings.Join(report.Failed(), "; "))
		return errInvariants
	}
	return nil
}

// demoLogger keeps the demo's screen for progress and the report: the
// services' logs (dead letters, alerts, restarts: all counted in the report)
// are shown only when KM0_LOG_LEVEL is set.
func demoLogger() *slog.Logger {
	if os.Getenv("KM0_LOG_LEVEL") != "" {
		return logger()
	}
	return slog.New(slog.DiscardHandler)
}
