package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/km0/km0/internal/hostguard"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
)

// systemConsole starts the operator console of a running system (km0 up
// --console, km0 demo --keep-running): its dead letters indexed in the
// database km0_dlq[_suffix] on adminURL's server (created if absent, dropped
// at stop when drop is set), from Kafka's <topic>.dlq topics, the RabbitMQ
// queues <queue>.dlq of its consumers, or both, by where its events travel
// (Config.Events); the lag of its outboxes, of its Kafka consumer groups
// (others on request) and of its RabbitMQ queues; and the health of its HTTP servers. It prints
// the console's URL.
// Lag over rule's thresholds for rule.For is logged and sent to the DLQ
// webhook ($KM0_DLQ_WEBHOOK), as by km0 console. With no
// $KM0_DLQ_ADMIN_TOKEN it makes a random token for the run (runToken) and
// prints the path of the file that holds it, so that letters are never open.
func systemConsole(ctx context.Context, sys *system.System, addr, adminURL, suffix string, brokers []string, drop bool, rule lag.Rule, out io.Writer, name string, log *slog.Logger) (stop func(), err error) {
	if adminURL == "" {
		return nil, errors.New("--console-addr needs --database-url (or $KM0_DATABASE_URL): the dead-letter index gets its own database km0_dlq on that server")
	}
	dbName := svc.DatabaseName("dlq", suffix)
	u, err := svc.EnsureDatabase(ctx, adminURL, dbName)
	if err != nil {
		return nil, err
	}
	pool, err := svc.OpenPool(ctx, u, 4)
	if err != nil {
		return nil, err
	}
	var closers []func()
	cleanup := func() {
		for _, c := range slices.Backward(closers) {
			c()
		}
	}
	closers = append(closers, pool.Close)
	if drop {
		closers = append([]func(){func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = svc.DropDatabase(dctx, adminURL, dbName)
		}}, closers...)
	}
	fail := func(err error) (func(), error) { cleanup(); return nil, err }
	if _, err := migrate.Up(ctx, pool, migrate.Names{}, dlq.Migrations); err != nil {
		return fail(err)
	}
	reg := prometheus.NewRegistry()
	al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, Logger: log, WebhookURL: os.Getenv("KM0_DLQ_WEBHOOK")})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer cancel()
		_ = al.Close(cctx)
	})
	parts, err := systemDeadLetters(ctx, sys, brokers, pool, al, name, log)
	closers = append(closers, parts.close...)
	if err != nil {
		return fail(err)
	}
	var outboxes []lag.Outbox
	for _, s := range slices.Sorted(maps.Keys(system.Topics)) {
		if p := sys.Pool(s); p != nil {
			outboxes = append(outboxes, lag.Outbox{Name: s, DB: p})
		}
	}
	addrs := sys.Addrs()
	var services []console.Service
	for _, k := range slices.Sorted(maps.Keys(addrs)) {
		services = append(services, console.Service{Name: k, URL: addrs[k]})
	}
	lcfg := lag.Config{Outboxes: outboxes, Brokers: parts.kafkaBrokers, Logger: log, ClientOpts: sys.KafkaOpts(),
		Groups: append(sys.ConsumerGroups(), dlq.GroupDefault), OmitUnlisted: true}
	if len(parts.queues) > 0 {
		lcfg.AMQP, lcfg.Queues = sys.EventsConn(), parts.queues
	}
	token := os.Getenv(adminTokenEnv)
	if token == "" {
		var path string
		var remove func()
		if token, path, remove, err = runToken(); err != nil {
			return fail(err)
		}
		closers = append(closers, remove)
		fmt.Fprintf(out, "%s: no $%s: this run's admin token is in %s (mode 0600, removed at stop); log in to the console with it\n", name, adminTokenEnv, path)
	}
	// Each service keeps its blocked keys and its paused groups in its own
	// database.
	var sdbs []console.ServiceDB
	for _, s := range slices.Sorted(maps.Keys(sys.DatabaseNames())) {
		if p := sys.Pool(s); p != nil {
			sdbs = append(sdbs, console.ServiceDB{Name: s, DB: p, Groups: sys.Groups(s)})
		}
	}
	_, stopConsole, err := serveConsole(ctx, consoleParts{addr: addr, allowed: strings.Split(os.Getenv(hostguard.AllowedHostsEnv), ","),
		token: token, source: parts.source, broker: parts.broker, alerter: al, serviceDBs: sdbs,
		lag:      lcfg,
		interval: lag.IntervalDefault, rule: rule, services: services, reg: reg, out: out, name: name, log: log})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, stopConsole)
	return cleanup, nil
}

// runToken makes a random admin token for one run of a system's console
// and writes it to a new file that only this user can read (never to the
// terminal or the log); remove deletes the file.
func runToken() (token, path string, remove func(), err error) {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	token = base64.RawURLEncoding.EncodeToString(b)
	f, err := os.CreateTemp("", "km0-admin-token-*") // mode 0600
	if err != nil {
		return "", "", nil, fmt.Errorf("console: the run's admin token: %w", err)
	}
	if _, err = f.WriteString(token + "\n"); err == nil {
		err = f.Close()
	}
	if err != nil {
		_ = f.Close()
		_ = os.Remove(f.Name())
		return "", "", nil, fmt.Errorf("console: the run's admin token: %w", err)
	}
	return token, f.Name(), func() { _ = os.Remove(f.Name()) }, nil
}

// alertFlags are the lag-alert thresholds of the console that km0 up
// --console and km0 demo --keep-running start: the flags of km0 console.
type alertFlags struct {
	maxLag   *thresholdFlag[int64]
	maxAge   *thresholdFlag[time.Duration]
	alertFor *time.Duration
}

func addAlertFlags(fs *flag.FlagSet, with string) *alertFlags {
	f := &alertFlags{maxLag: &thresholdFlag[int64]{}, maxAge: &thresholdFlag[time.Duration]{},
		alertFor: fs.Duration("alert-for", 5*time.Minute, with+": how long a lag threshold must be exceeded before the alert")}
	fs.Var(f.maxLag, "max-lag", with+": alert (log and $KM0_DLQ_WEBHOOK) when a group's lag or an outbox's pending rows stay over this for --alert-for (0: any lag; default: off)")
	fs.Var(f.maxAge, "max-age", with+": alert when a group's oldest unprocessed record or an outbox's oldest row stays older than this for --alert-for (0: any age; default: off)")
	return f
}

func (f *alertFlags) rule() lag.Rule {
	return lag.Rule{MaxLag: f.maxLag.v, LagSet: f.maxLag.set, MaxAge: f.maxAge.v, AgeSet: f.maxAge.set, For: *f.alertFor}
}

// check refuses thresholds that no console would watch, and bad values.
func (f *alertFlags) check(console bool, with string) error {
	if *f.alertFor < 0 {
		return errors.New("--alert-for must not be negative")
	}
	if !console && (f.maxLag.set || f.maxAge.set) {
		return fmt.Errorf("--max-lag and --max-age are thresholds of the console: they need %s", with)
	}
	return nil
}

// consoleSyncInterval is how often the console takes the dead letters of
// the system's RabbitMQ DLQs into its index.
const consoleSyncInterval = 2 * time.Second

// deadLetterParts is the dead-letter side of a system's console.
type deadLetterParts struct {
	source       dlq.Source
	broker       string   // "Kafka", "RabbitMQ" or both
	kafkaBrokers []string // the Kafka whose groups have lag; nil when no event is on Kafka
	queues       []string // the RabbitMQ queues whose lag to show
	close        []func() // in order of opening
}

// systemDeadLetters builds the dead-letter source of sys's console over the
// brokers its events travel on, and starts what keeps the index up to date:
// Kafka's indexer (a consumer group on the DLQ topics) and, every
// consoleSyncInterval, a sync of the RabbitMQ DLQs (reading a RabbitMQ
// queue takes its messages: the index keeps them). New letters go to al.
func systemDeadLetters(ctx context.Context, sys *system.System, brokers []string, pool *pgxpool.Pool, al *dlq.Alerter, name string, log *slog.Logger) (deadLetterParts, error) {
	var p deadLetterParts
	onKafka := slices.Contains(slices.Collect(maps.Values(sys.EventsBroker())), system.EventsKafka)
	work, dead := sys.EventsConsumerQueues()
	store := dlq.NewStore(pool, "")
	var kafkaBackend *dlq.KafkaBackend
	var amqpBackend *dlq.AMQPBackend
	var kcfg dlq.KafkaConfig
	if onKafka {
		if len(brokers) == 0 {
			return p, errors.New("the console needs the Kafka brokers of the events on Kafka")
		}
		kcfg = dlq.KafkaConfig{Brokers: brokers, Logger: log, ClientOpts: sys.KafkaOpts()}
		b, err := dlq.NewKafkaBackend(kcfg)
		if err != nil {
			return p, err
		}
		p.close = append(p.close, b.Close)
		kafkaBackend, p.kafkaBrokers = b, brokers
	}
	if len(dead) > 0 {
		b, err := dlq.NewAMQPBackend(dlq.AMQPConfig{Conn: sys.EventsConn(), Queues: dead, Logger: log})
		if err != nil {
			return p, err
		}
		p.close = append(p.close, func() { _ = b.Close() })
		amqpBackend, p.queues = b, work
	}
	var backend dlq.Backend
	switch {
	case kafkaBackend != nil && amqpBackend != nil:
		m, err := dlq.NewMixedBackend(kafkaBackend, amqpBackend)
		if err != nil {
			return p, err
		}
		backend, p.broker = m, "Kafka + RabbitMQ"
	case amqpBackend != nil:
		backend, p.broker = amqpBackend, "RabbitMQ"
	case kafkaBackend != nil:
		backend, p.broker = kafkaBackend, "Kafka"
	default:
		return p, errors.New("the console found no broker carrying the events")
	}
	src, err := dlq.NewService(dlq.ServiceConfig{Store: store, Backend: backend, Alerter: al, Logger: log})
	if err != nil {
		return p, err
	}
	p.source = src
	bctx, cancel := context.WithCancel(ctx)
	var running sync.WaitGroup
	p.close = append(p.close, func() { cancel(); running.Wait() })
	if kafkaBackend != nil {
		ix, err := dlq.NewIndexer(dlq.IndexerConfig{Kafka: kcfg, Store: store, Alerter: al})
		if err != nil {
			return p, err
		}
		running.Go(func() {
			if err := ix.Run(bctx); err != nil && bctx.Err() == nil {
				log.Error(name+": dead-letter indexer stopped", "err", err)
			}
		})
	}
	if amqpBackend != nil {
		// Only RabbitMQ's: Kafka's letters come through the indexer.
		rabbit, err := dlq.NewService(dlq.ServiceConfig{Store: store, Backend: amqpBackend, Alerter: al, Logger: log})
		if err != nil {
			return p, err
		}
		running.Go(func() { _ = syncEvery(bctx, rabbit, consoleSyncInterval, log) })
	}
	return p, nil
}
