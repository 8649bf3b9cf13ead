package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/pause"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

func init() {
	register(&command{name: "relay", summary: "publish committed outbox rows to Kafka (or a RabbitMQ exchange), in commit order per aggregate", run: runRelay})
}

func runRelay(ctx context.Context, args []string) error {
	fs := cli.NewFlags("relay", "publish committed outbox events to Kafka or a RabbitMQ exchange, in commit order per aggregate, "+
		"at least once: --mode polling (the default) claims pending rows from the table, publishes them, waits for every ack "+
		"and marks them; --mode cdc streams them from the WAL (logical replication) and confirms the slot's position once the "+
		"broker acked; --outbox wal (implies --mode cdc) streams the events written as WAL messages, with no table")
	dbURL := cli.DatabaseURLFlag(fs)
	brokers := cli.BrokersFlag(fs)
	ksec := cli.KafkaSecurityFlags(fs)
	ktopics := cli.NewKafkaTopicFlags(fs)
	topic := fs.String("topic", "", "Kafka topic for the events (required), e.g. comandes.esdeveniments")
	origin := fs.String("origin", "", "the envelope's origen (required), e.g. comandes")
	schema := fs.String("schema", migrate.SchemaDefault, "PostgreSQL schema of the outbox")
	table := fs.String("outbox-table", migrate.OutboxDefault, "outbox table name")
	batch := fs.Int("batch", 0, fmt.Sprintf("rows per claim, fixed; 0 (the default) adapts each claim to the backlog, %d..%d; "+
		"--mode cdc: most rows per publish, default %d", relay.BatchSizeStart, relay.BatchSizeAdaptiveMax, cdc.BatchSizeDefault))
	workers := fs.Int("workers", 0, fmt.Sprintf("claim workers, fixed (each one session and its own shards); 0 (the default) runs one, and up to %d under a backlog",
		relay.WorkersDefault))
	poll := fs.Duration("poll", relay.PollIntervalDefault, "fallback poll interval when no NOTIFY arrives")
	partitions := fs.Int("partitions", kafka.PartitionsDefault, "partitions of the topic if it has to be created")
	exchange := fs.String("exchange", "", "publish to this RabbitMQ exchange (routing key = --topic) instead of Kafka")
	amqpURL := cli.SecretString(fs, "amqp-url", os.Getenv("KM0_AMQP_URL"), "RabbitMQ URL, with --exchange (default $KM0_AMQP_URL, else the local guest broker)")
	amqpTLS := cli.AddAMQPTLSFlags(fs)
	metricsAddr := fs.String("http-addr", "", "serve Prometheus metrics at http://ADDR/metrics and the liveness probe http://ADDR"+relayHealthPath+" (default off)")
	pruneOlder := fs.Duration("prune-older-than", 0, "delete published rows older than this, a pass every minute (default 0: off; keep it at least your replay window)")
	deletePublished := fs.Bool("delete-published", false, "delete each row as soon as the broker confirmed it, instead of setting publicat_en: the outbox keeps only pending rows and nothing can be replayed from it")
	mode := fs.String("mode", modePolling, "polling: claim pending rows from the table (LISTEN/NOTIFY and a fallback poll); "+
		"cdc: stream the table's inserts from the WAL (logical replication; needs wal_level = logical and the REPLICATION privilege)")
	slot := fs.String("slot", "", "--mode cdc: the replication slot (default km0_<database>_<schema>_<table>, e.g. km0_shop_public_outbox; "+
		"--outbox wal: km0_wal_<database>_<schema>_<table>)")
	outboxMode := fs.String("outbox", string(outbox.ModeTable), "table: the events are rows of the outbox table; "+
		"wal: they are WAL messages (outbox.ModeWAL, created by km0 migrate --outbox-mode wal), streamed with --mode cdc (implied)")
	publication := fs.String("publication", "", "--mode cdc: the publication of the table's inserts, created if absent (default the slot's name)")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *outboxMode == string(outbox.ModeWAL) && !set["mode"] {
		*mode = modeCDC
	}
	if err := checkMode(*mode, *outboxMode, *slot, *publication, *workers, set); err != nil {
		return err
	}
	if *topic == "" || *origin == "" {
		return errors.New("--topic and --origin are required")
	}
	// Checked before any connection: relay.New would see them only once
	// Kafka answers, and would turn 0 into the default.
	if err := relay.CheckSizes(*batch, *workers, "--batch", "--workers"); err != nil {
		return err
	}
	if *exchange == "" {
		if err := kafka.CheckTopic(*topic); err != nil {
			return fmt.Errorf("--topic: %w", err)
		}
	}
	switch {
	case *poll <= 0:
		return fmt.Errorf("--poll %v must be positive", *poll)
	case *partitions < 1:
		return fmt.Errorf("--partitions %d must be at least 1", *partitions)
	case *pruneOlder < 0:
		return fmt.Errorf("--prune-older-than %v must be positive (or 0: off)", *pruneOlder)
	}
	topicSettings, err := ktopics.Settings(false)
	if err != nil {
		return err
	}
	log := cli.Logger()
	pool, err := cli.OpenPool(ctx, *dbURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	names := migrate.Names{Schema: *schema, Outbox: *table}.WithDefaults()
	wal := *outboxMode == string(outbox.ModeWAL)
	if err := relay.CheckOutbox(ctx, pool, names, wal); err != nil {
		return err
	}
	if *mode == modeCDC {
		// Refuse at once, naming the setting or the privilege, when the
		// server cannot serve CDC, before waiting for the broker.
		if err := cdc.CheckServer(ctx, pool, names, log); err != nil {
			return err
		}
	}
	var pub transport.Publisher
	maxRecord := relay.MaxRecordBytesDefault
	if *exchange != "" {
		tlsCfg, err := amqpTLS.Config()
		if err != nil {
			return err
		}
		conn, err := amqp.Dial(ctx, amqp.Config{URL: *amqpURL, Name: "km0-relay", Logger: log, TLS: tlsCfg})
		if err != nil {
			return err
		}
		defer conn.Close()
		if pub, err = amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: *exchange, Logger: log}); err != nil {
			return err
		}
	} else {
		bs, err := cli.RequireBrokers(*brokers)
		if err != nil {
			return err
		}
		kopts, err := ksec.Opts(ctx, bs, log)
		if err != nil {
			return err
		}
		cl, err := kafka.NewClient(bs, kopts...)
		if err != nil {
			return err
		}
		defer cl.Close()
		if ok, err := waitForTopic(ctx, log, cl, topicSettings.Spec(*topic, int32(*partitions))); !ok {
			return err
		}
		pcl := cl
		// Park rows over the topic's own limit before sending them, so that a
		// refused record can never be overtaken by a later one of its
		// aggregate in the same chunk; and keep each produced batch within
		// that limit too (Kafka refuses a whole batch, and a record resent on
		// its own would land behind later ones of its partition).
		if limit, err := kafka.MaxMessageBytes(ctx, cl, *topic); err != nil {
			log.Warn("km0 relay: cannot read the topic's size limit; using the default", "err", err)
		} else if limit-1024 < maxRecord {
			maxRecord = limit - 1024
			if pcl, err = kafka.NewClient(bs, append(slices.Clip(kopts), kgo.ProducerBatchMaxBytes(int32(limit)))...); err != nil {
				return err
			}
			defer pcl.Close()
		}
		pub = kafka.NewPublisher(pcl)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	rcfg := relay.Config{Pool: pool, Names: names, Publisher: pub, Topic: *topic,
		Origin: *origin, MaxRecordBytes: maxRecord, BatchSize: *batch, Workers: *workers, PollInterval: *poll, Logger: log, Metrics: reg,
		PruneOlderThan: *pruneOlder, DeletePublished: *deletePublished}
	var run func(context.Context) error
	if *mode == modeCDC {
		c, err := cdc.New(cdc.Config{Config: rcfg, Slot: *slot, Publication: *publication, BatchSize: *batch, WAL: wal})
		if err != nil {
			return err
		}
		defer c.Close()
		run = c.Run
		log.Info("km0 relay: CDC", "slot", c.Slot(), "publication", c.Publication())
	} else {
		r, err := relay.New(rcfg)
		if err != nil {
			return err
		}
		defer r.Close()
		run = r.Run
	}
	if *metricsAddr != "" {
		ln, err := net.Listen("tcp", *metricsAddr)
		if err != nil {
			return fmt.Errorf("--metrics-addr: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.Handle("GET "+relayHealthPath, relayHealth())
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute}
		go func() { _ = srv.Serve(ln) }()
		defer srv.Close()
		log.Info("km0 relay: metrics", "url", "http://"+ln.Addr().String()+"/metrics")
	}
	log.Info("km0 relay: running", startAttrs(*mode, *outboxMode, names, *topic, *origin, *batch, *workers, *pruneOlder, *deletePublished)...)
	err = run(ctx)
	log.Info("km0 relay: stopped")
	return err
}

// Relay modes of --mode.
const (
	modePolling = "polling"
	modeCDC     = "cdc"
)

// relayFlags name, in cdc.CheckMode's errors, the relays, the outbox modes
// and the settings as km0 relay's flags.
var relayFlags = map[string]string{"CDC": "--mode cdc", "Polling": "--mode polling", "WAL": "--outbox wal", "Table": "--outbox table",
	"Slot": "--slot", "Publication": "--publication", "Workers": "--workers", "PollInterval": "--poll",
	"PruneOlderThan": "--prune-older-than", "DeletePublished": "--delete-published"}

// checkMode refuses a --mode other than polling or cdc, an --outbox other
// than table or wal, and the flags given (set) that belong to another mode
// (cdc.CheckMode).
func checkMode(mode, outboxMode, slot, publication string, workers int, set map[string]bool) error {
	if outboxMode != string(outbox.ModeTable) && outboxMode != string(outbox.ModeWAL) {
		return fmt.Errorf("--outbox %q: want %s or %s", outboxMode, outbox.ModeTable, outbox.ModeWAL)
	}
	if mode != modePolling && mode != modeCDC {
		return fmt.Errorf("--mode %q: want %s or %s", mode, modePolling, modeCDC)
	}
	var given []string
	for field, on := range map[string]bool{"Slot": slot != "", "Publication": publication != "", "Workers": workers != 0,
		"PollInterval": set["poll"], "PruneOlderThan": set["prune-older-than"], "DeletePublished": set["delete-published"]} {
		if on {
			given = append(given, field)
		}
	}
	return cdc.CheckMode(mode == modeCDC, outboxMode == string(outbox.ModeWAL), given, slot, relayFlags)
}

// waitForTopic creates or checks topic, retrying while Kafka is down (rows
// wait in the outbox meanwhile). It returns false if ctx ends first (nil
// error), or with the error if the brokers refuse the topic for good (an
// illegal name, no authorisation): retrying that would loop forever.
func waitForTopic(ctx context.Context, log *slog.Logger, cl *kgo.Client, spec kafka.TopicSpec) (bool, error) {
	topic := spec.Name
	for fails := 1; ; fails++ {
		wait := pause.Backoff(time.Second, 30*time.Second, fails)
		topicCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := kafka.EnsureTopicSpecs(topicCtx, cl, log, spec)
		cancel()
		if err == nil {
			return true, nil
		}
		if errors.Is(err, kafka.ErrTopicRefused) {
			return false, fmt.Errorf("--topic: %w", err)
		}
		if ctx.Err() != nil {
			return false, nil
		}
		log.Warn("km0 relay: cannot create or check the topic; retrying", "topic", topic, "err", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return false, nil
		case <-time.After(wait):
		}
	}
}

// startAttrs are the attributes of the relay's start line: each mode's own
// settings, with the value it runs with (the CDC relay has a fixed batch
// and no workers; a WAL-mode outbox no pruning).
func startAttrs(mode, outboxMode string, names migrate.Names, topic, origin string, batch, workers int, pruneOlder time.Duration, del bool) []any {
	attrs := []any{"mode", mode, "outbox", names.Schema + "." + names.Outbox, "outbox_mode", outboxMode, "topic", topic, "origin", origin}
	if mode == modeCDC {
		attrs = append(attrs, "batch", cmp.Or(batch, cdc.BatchSizeDefault))
	} else {
		attrs = append(attrs, "batch", adaptiveOr(batch), "workers", adaptiveOr(workers))
	}
	if outboxMode != string(outbox.ModeWAL) {
		attrs = append(attrs, "prune_older_than", pruneOlder, "delete_published", del)
	}
	return attrs
}

// adaptiveOr is n, or "adaptive" for 0 (the relay's adaptive default).
func adaptiveOr(n int) any {
	if n == 0 {
		return "adaptive"
	}
	return n
}

// flagSet reports whether the flag name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
