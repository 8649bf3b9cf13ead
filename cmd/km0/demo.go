package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/services/demo"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/requestreply"
)

func init() {
	register(&command{name: "demo", summary: "run the Quilòmetre Zero system end to end with failures injected and reconcile it", run: runDemo})
}

// errInvariants makes km0 demo exit 1 after printing the failed invariants.
var errInvariants = errors.New("invariants failed")

func runDemo(ctx context.Context, args []string) error {
	fs := cli.NewFlags("demo", "start an embedded Kafka, PostgreSQL databases and the six services, drive orders with failures injected, and print a reconciliation report (exit 0 only if every invariant holds)")
	orders := fs.Int("orders", demo.OrdersDefault, "number of orders to submit (with --chaos the default is 2000)")
	clients := fs.Int("clients", demo.ClientsDefault, "concurrent HTTP clients")
	keep := fs.Bool("keep-running", false, "leave the services, their HTTP APIs and the operator console up after the report (Ctrl-C stops them)")
	consoleAddr := fs.String("console-addr", consoleAddrDefault, "with --keep-running: the operator console's address (empty: none; token $"+dlqcli.AdminTokenEnv+", unset: one for the run in a 0600 file whose path is printed)")
	alerts := addAlertFlags(fs, "with --keep-running")
	asJSON := fs.Bool("json", false, "print the report as JSON on stdout (progress goes to stderr)")
	authorize := fs.Bool("authorize", true, "comandes authorises each order with pagaments by request/reply (RabbitMQ if KM0_AMQP_URL is set or --events puts events there, else the embedded Kafka; on by default in km0 demo to show request/reply, off in km0 up and km0 serve, which run the asynchronous flow alone unless asked)")
	keepDB := fs.Bool("keep-databases", false, "do not drop the run's km0_<service>_demo_<run> databases")
	seed := fs.Uint64("seed", 1, "scenario seed (with --chaos: also the fault schedule; default there a random seed, printed)")
	chaos := fs.Bool("chaos", false, "run the services and the broker as separate processes, SIGKILL and restart them while orders flow, "+
		"produce poison records, then check that the system settles and every invariant holds (see --kills, --duration, --own-postgres)")
	kills := fs.Int("kills", demo.ChaosKillsDefault, "with --chaos: SIGKILLs of services at random moments")
	duration := fs.Duration("duration", demo.ChaosDurationDefault, "with --chaos: orders are spread over this time and the faults fall within it")
	brokerDown := fs.Duration("broker-down", demo.ChaosBrokerDownDefault, "with --chaos: how long the broker stays SIGKILLed (0: never killed)")
	ownPG := fs.Bool("own-postgres", false, "with --chaos: run a throwaway PostgreSQL cluster (initdb, the machine's binaries) and restart it -m fast and -m immediate during the run")
	settle := fs.Duration("settle-timeout", demo.ChaosSettleTimeoutDefault, "with --chaos: how long to wait for the system to settle after the last fault")
	keepDir := fs.Bool("keep-logs", false, "with --chaos: keep the folder with the processes' logs (always kept when the run fails)")
	events := cli.EventsFlag(fs)
	kafkaDown := fs.Duration("kafka-down", 0, "make the embedded Kafka unreachable for this long once a third of the orders are in: with --events kafka,comandes.esdeveniments=rabbitmq inventari keeps taking stock meanwhile, with the orders on Kafka it stops; nothing is lost either way (default 0: never)")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if err := alerts.check(*keep && *consoleAddr != "", "--keep-running (and --console-addr)"); err != nil {
		return err
	}
	evBroker, evTopics, err := system.ParseEvents(*events)
	if err != nil {
		return fmt.Errorf("--events: %w", err)
	}
	// Signed by default: the demo's own processes (the --chaos children
	// inherit the environment) share a key generated for this run.
	if requestreply.SigningKeyFromEnv() == nil {
		key, err := newSigningKey()
		if err != nil {
			return err
		}
		if err := os.Setenv(requestreply.SigningKeyEnv, string(key)); err != nil {
			return err
		}
	}
	if *chaos {
		if evBroker == system.EventsRabbitMQ || len(evTopics) > 0 || *kafkaDown > 0 {
			return errors.New("--chaos runs its events on Kafka only: it SIGKILLs its own broker process, and the RabbitMQ it would kill is the machine's (drop --events; --broker-down is its Kafka outage)")
		}
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		return runChaos(ctx, set, demo.ChaosConfig{Orders: pick(set["orders"], *orders, demo.ChaosOrdersDefault), Clients: *clients,
			Kills: *kills, NoKills: *kills == 0, Duration: *duration, BrokerDown: *brokerDown, NoBrokerKill: *brokerDown == 0,
			OwnPostgres: *ownPG, NoAuthorize: !*authorize, SettleTimeout: *settle, Seed: pick(set["seed"], *seed, 0), KeepDir: *keepDir}, *asJSON)
	}
	progress := os.Stdout
	if *asJSON {
		progress = os.Stderr
	}
	var report *demo.Report
	_, err = demo.Run(ctx, demo.Config{
		Orders: *orders, Clients: *clients, AMQPURL: os.Getenv("KM0_AMQP_URL"), NoAuthorize: !*authorize,
		Events: evBroker, EventsByTopic: evTopics, KafkaDown: *kafkaDown,
		KeepRunning: *keep, KeepDatabases: *keepDB, Seed: *seed, Out: progress, Logger: demoLogger(),
		OnRunning: func(ctx context.Context, r demo.Running) (func(), error) {
			if *consoleAddr == "" {
				return func() {}, nil
			}
			return systemConsole(ctx, r.System, *consoleAddr, r.DatabaseURL, r.DatabaseSuffix, r.Brokers, !*keepDB, alerts.rule(), progress, "km0 demo", demoLogger())
		},
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

func pick[T any](set bool, v, otherwise T) T {
	if set {
		return v
	}
	return otherwise
}

// runChaos runs km0 demo --chaos: progress on stderr, the report on stdout.
func runChaos(ctx context.Context, set map[string]bool, cfg demo.ChaosConfig, asJSON bool) error {
	for _, f := range []string{"keep-running", "keep-databases", "console", "max-lag", "max-age", "alert-for"} {
		if set[f] {
			return fmt.Errorf("--%s does not apply to --chaos", f)
		}
	}
	cfg.Out = os.Stderr
	cfg.DatabaseURL = os.Getenv("KM0_DATABASE_URL")
	cfg.OnReport = func(r *demo.ChaosReport) {
		if asJSON {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			_ = enc.Encode(r)
			return
		}
		r.Print(os.Stdout)
	}
	report, err := demo.RunChaos(ctx, cfg)
	if err != nil {
		return err
	}
	if !report.OK {
		fmt.Fprintf(os.Stderr, "km0 demo --chaos: failed invariants: %s (seed %d; logs in %s)\n", strings.Join(report.Failed(), "; "), report.Seed, report.Dir)
		return errInvariants
	}
	return nil
}

// demoLogger keeps the demo's screen for progress and the report: the
// services' logs (dead letters, alerts, restarts: all counted in the report)
// are shown only when KM0_LOG_LEVEL is set.
func demoLogger() *slog.Logger {
	if os.Getenv("KM0_LOG_LEVEL") != "" {
		return cli.Logger()
	}
	return slog.New(slog.DiscardHandler)
}
