package system

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/amqpdlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport/amqp/amqplag"
	"github.com/twmb/franz-go/pkg/kgo"
)

// ConsoleSyncInterval is how often a system's console takes the dead
// letters of its RabbitMQ DLQs into its index.
const ConsoleSyncInterval = 2 * time.Second

// ConsoleConfig places the operator console's own state of a running
// System (km0 up --console, km0 demo --keep-running).
type ConsoleConfig struct {
	// AdminURL is a PostgreSQL URL of the server where the dead-letter index
	// gets its database, km0_dlq[_Suffix] (created if absent). Required.
	AdminURL string
	Suffix   string
	// Drop drops that database at Close.
	Drop bool
	// Brokers are the Kafka brokers of the events on Kafka.
	Brokers []string
	Logger  *slog.Logger
	// Name prefixes the log lines (the command, e.g. "km0 up").
	Name string
}

// Console is what the operator console of a running System reads: its dead
// letters indexed in their own database, from Kafka's <topic>.dlq topics,
// the RabbitMQ queues <queue>.dlq of its consumers, or both, by where its
// events travel (Config.Events), kept up to date while it is open; the lag
// of its outboxes, of its Kafka consumer groups and of its RabbitMQ queues;
// its HTTP servers; and each service's database (blocked keys, paused
// groups). Close stops and closes what OpenConsole started.
type Console struct {
	Source   dlq.Source
	Broker   string // "Kafka", "RabbitMQ" or "Kafka + RabbitMQ"
	Alerter  *dlq.Alerter
	Registry *prometheus.Registry // the alerter's metrics
	// Lag is what the lag page measures; LagBrokers (with LagClientOpts)
	// are the Kafka brokers whose groups it measures through a
	// kafkalag probe the caller opens.
	Lag           lag.Config
	LagBrokers    []string
	LagClientOpts []kgo.Opt
	Services      []console.Service
	ServiceDBs    []console.ServiceDB

	closers []func() // in order of opening
}

// OpenConsole opens the console's parts of s (see Console). New letters and
// lag alerts go to the alerter, whose webhook is $KM0_DLQ_WEBHOOK.
func (s *System) OpenConsole(ctx context.Context, cfg ConsoleConfig) (*Console, error) {
	if cfg.AdminURL == "" {
		return nil, errors.New("--console-addr needs --database-url (or $KM0_DATABASE_URL): the dead-letter index gets its own database km0_dlq on that server")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	log := cfg.Logger
	dbName := svc.DatabaseName("dlq", cfg.Suffix)
	u, err := svc.EnsureDatabase(ctx, cfg.AdminURL, dbName)
	if err != nil {
		return nil, err
	}
	pool, err := svc.OpenPool(ctx, u, 4)
	if err != nil {
		return nil, err
	}
	c := &Console{}
	c.closers = append(c.closers, pool.Close)
	if cfg.Drop {
		c.closers = append([]func(){func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = svc.DropDatabase(dctx, cfg.AdminURL, dbName)
		}}, c.closers...)
	}
	fail := func(err error) (*Console, error) { c.Close(); return nil, err }
	if _, err := migrate.Up(ctx, pool, migrate.Names{}, dlq.Migrations); err != nil {
		return fail(err)
	}
	c.Registry = prometheus.NewRegistry()
	al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: c.Registry, Logger: log, WebhookURL: os.Getenv("KM0_DLQ_WEBHOOK")})
	if err != nil {
		return fail(err)
	}
	c.Alerter = al
	c.closers = append(c.closers, func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer cancel()
		_ = al.Close(cctx)
	})
	kafkaBrokers, queues, err := c.deadLetters(ctx, s, cfg, dlq.NewStore(pool, ""))
	if err != nil {
		return fail(err)
	}
	var outboxes []lag.Outbox
	for _, name := range slices.Sorted(maps.Keys(Topics)) {
		if p := s.Pool(name); p != nil {
			// In WAL mode each service's slot is the default of its database.
			outboxes = append(outboxes, lag.Outbox{Name: name, DB: p, WAL: s.OutboxMode() == outbox.ModeWAL})
		}
	}
	addrs := s.Addrs()
	for _, k := range slices.Sorted(maps.Keys(addrs)) {
		c.Services = append(c.Services, console.Service{Name: k, URL: addrs[k]})
	}
	c.Lag = lag.Config{Outboxes: outboxes, Logger: log,
		Groups: append(s.ConsumerGroups(), kafkadlq.GroupDefault), OmitUnlisted: true}
	c.LagBrokers, c.LagClientOpts = kafkaBrokers, s.KafkaOpts()
	if len(queues) > 0 {
		c.Lag.RabbitMQ, c.Lag.Queues = amqplag.New(s.EventsConn()), queues
	}
	for _, name := range slices.Sorted(maps.Keys(s.DatabaseNames())) {
		if p := s.Pool(name); p != nil {
			c.ServiceDBs = append(c.ServiceDBs, console.ServiceDB{Name: name, DB: p, Groups: s.Groups(name)})
		}
	}
	return c, nil
}

// Close stops what keeps the index up to date and closes the console's
// parts, in the reverse order of opening.
func (c *Console) Close() {
	for _, f := range slices.Backward(c.closers) {
		f()
	}
	c.closers = nil
}

// deadLetters builds the dead-letter source over the brokers s's events
// travel on, and starts what keeps the index up to date: Kafka's indexer
// (a consumer group on the DLQ topics) and, every ConsoleSyncInterval, a
// sync of the RabbitMQ DLQs (reading a RabbitMQ queue takes its messages:
// the index keeps them). It returns the Kafka brokers whose groups have lag
// (nil when no event is on Kafka) and the RabbitMQ queues whose lag to show.
func (c *Console) deadLetters(ctx context.Context, s *System, cfg ConsoleConfig, store *dlq.Store) (kafkaBrokers, queues []string, err error) {
	log := cfg.Logger
	onKafka := slices.Contains(slices.Collect(maps.Values(s.EventsBroker())), EventsKafka)
	work, dead := s.EventsConsumerQueues()
	var kafkaBackend *kafkadlq.Backend
	var amqpBackend *amqpdlq.Backend
	var kcfg kafkadlq.Config
	if onKafka {
		if len(cfg.Brokers) == 0 {
			return nil, nil, errors.New("the console needs the Kafka brokers of the events on Kafka")
		}
		kcfg = kafkadlq.Config{Brokers: cfg.Brokers, Logger: log, ClientOpts: s.KafkaOpts()}
		b, err := kafkadlq.New(kcfg)
		if err != nil {
			return nil, nil, err
		}
		c.closers = append(c.closers, b.Close)
		kafkaBackend, kafkaBrokers = b, cfg.Brokers
	}
	if len(dead) > 0 {
		b, err := amqpdlq.New(amqpdlq.Config{Conn: s.EventsConn(), Queues: dead, Logger: log})
		if err != nil {
			return nil, nil, err
		}
		c.closers = append(c.closers, func() { _ = b.Close() })
		amqpBackend, queues = b, work
	}
	var backend dlq.Backend
	switch {
	case kafkaBackend != nil && amqpBackend != nil:
		m, err := dlq.NewMixedBackend(kafkaBackend, amqpBackend)
		if err != nil {
			return nil, nil, err
		}
		backend, c.Broker = m, "Kafka + RabbitMQ"
	case amqpBackend != nil:
		backend, c.Broker = amqpBackend, "RabbitMQ"
	case kafkaBackend != nil:
		backend, c.Broker = kafkaBackend, "Kafka"
	default:
		return nil, nil, errors.New("the console found no broker carrying the events")
	}
	src, err := dlq.NewService(dlq.ServiceConfig{Store: store, Backend: backend, Alerter: c.Alerter, Logger: log})
	if err != nil {
		return nil, nil, err
	}
	c.Source = src
	bctx, cancel := context.WithCancel(ctx)
	var running sync.WaitGroup
	c.closers = append(c.closers, func() { cancel(); running.Wait() })
	if kafkaBackend != nil {
		ix, err := kafkadlq.NewIndexer(kafkadlq.IndexerConfig{Kafka: kcfg, Store: store, Alerter: c.Alerter})
		if err != nil {
			return nil, nil, err
		}
		running.Go(func() {
			if err := ix.Run(bctx); err != nil && bctx.Err() == nil {
				log.Error(cfg.Name+": dead-letter indexer stopped", "err", err)
			}
		})
	}
	if amqpBackend != nil {
		// Only RabbitMQ's: Kafka's letters come through the indexer.
		rabbit, err := dlq.NewService(dlq.ServiceConfig{Store: store, Backend: amqpBackend, Alerter: c.Alerter, Logger: log})
		if err != nil {
			return nil, nil, err
		}
		running.Go(func() { syncEvery(bctx, rabbit, ConsoleSyncInterval, log) })
	}
	return kafkaBrokers, queues, nil
}

// syncEvery syncs src now and then every interval until ctx ends. A failed
// sync is logged and tried again at the next tick.
func syncEvery(ctx context.Context, src dlq.Source, interval time.Duration, log *slog.Logger) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if _, err := src.Sync(ctx); err != nil && ctx.Err() == nil {
			log.Error("km0 dlq index: sync failed; trying again", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
