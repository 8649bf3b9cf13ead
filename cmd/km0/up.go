package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/hostguard"

	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

func init() {
	register(&command{name: "up", summary: "run all six km0 services in one process", run: func(ctx context.Context, args []string) error {
		return runServices(ctx, "up", system.Services, args)
	}})
	register(&command{name: "serve", summary: "run one km0 service: km0 serve NAME (comandes, inventari, pagaments, repartiment, analitica, cataleg)", run: runServe})
}

func runServe(ctx context.Context, args []string) error {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		fmt.Fprintf(os.Stderr, "usage: km0 serve NAME [flags]   NAME is one of %s\n", strings.Join(system.Services, ", "))
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help") {
			return runServices(ctx, "serve NAME", nil, args[:1]) // prints the flags
		}
		return cli.ErrUsage
	}
	if !slices.Contains(system.Services, args[0]) {
		// Before any flag or database is looked at.
		return fmt.Errorf("unknown service %q: NAME is one of %s", args[0], strings.Join(system.Services, ", "))
	}
	return runServices(ctx, "serve "+args[0], []string{args[0]}, args[1:])
}

// httpServers are the names --http accepts: the services with an HTTP API
// and the simulated gateway and maps service.
var httpServers = []string{comandes.Name, inventari.Name, repartiment.Name, analitica.Name, cataleg.Name, system.GatewayName, system.MapsName}

// parseHTTPAddrs reads --http NAME=ADDR,... for a process that runs
// services (gateway: --gateway-url). A NAME without an HTTP server
// (pagaments), or whose server this process does not start, is refused
// rather than ignored.
func parseHTTPAddrs(spec string, services []string, gateway string) (map[string]string, error) {
	addrs := map[string]string{}
	for _, kv := range strings.Split(spec, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		switch {
		case k == pagaments.Name:
			return nil, fmt.Errorf("--http-addr %q: pagaments has no HTTP API (it consumes events and answers authorisations over request/reply); NAME is one of %s",
				kv, strings.Join(httpServers, ", "))
		case !ok || v == "" || !slices.Contains(httpServers, k):
			return nil, fmt.Errorf("--http-addr %q: want NAME=ADDR with NAME one of %s", kv, strings.Join(httpServers, ", "))
		}
		owner := k
		switch k {
		case system.GatewayName:
			owner = pagaments.Name
			if gateway != "" {
				return nil, fmt.Errorf("--http-addr %q: the simulated gateway does not run with --gateway-url", kv)
			}
		case system.MapsName:
			owner = repartiment.Name
		}
		if !slices.Contains(services, owner) {
			return nil, fmt.Errorf("--http-addr %q: %s does not run in this process (it runs %s)", kv, k, strings.Join(services, ", "))
		}
		if _, dup := addrs[k]; dup {
			return nil, fmt.Errorf("--http-addr %q: %s given twice", kv, k)
		}
		addrs[k] = v
	}
	return addrs, nil
}

func runServices(ctx context.Context, name string, services []string, args []string) error {
	fs := cli.NewFlags(name, "run km0 services: each with its database (its own URL, or km0_<service> created on the --database-url server; migrated), outbox relay, consumers and HTTP API")
	dbURL := cli.DatabaseURLFlag(fs)
	// A service's own database: KM0_<SERVICE>_DATABASE_URL, or for km0 serve
	// NAME also --service-database-url.
	own := map[string]string{}
	for _, s := range services {
		if v := os.Getenv(serviceDatabaseEnv(s)); v != "" {
			own[s] = v
		}
	}
	var serviceURL *string
	if strings.HasPrefix(name, "serve") {
		env, def := "KM0_<SERVICE>_DATABASE_URL", ""
		if len(services) == 1 {
			env, def = serviceDatabaseEnv(services[0]), own[services[0]]
		}
		serviceURL = cli.SecretString(fs, "service-database-url", def,
			"this service's own PostgreSQL database, used as is: migrated, never created (default $"+env+"; empty: km0_<service> on the --database-url server)")
	}
	topics := fs.String("topics", os.Getenv("KM0_TOPICS"), "rename domain topics: CONTRACT=NAME,... e.g. comandes.esdeveniments=prod.comandes (default $KM0_TOPICS; .retry and .dlq follow; give every process the same)")
	groups := fs.String("groups", os.Getenv("KM0_GROUPS"), "rename consumer groups: CONSUMIDOR=GROUP,... e.g. cataleg.estoc_baix=cataleg-prod (default $KM0_GROUPS)")
	brokers := cli.BrokersFlag(fs)
	ksec := cli.KafkaSecurityFlags(fs)
	ktopics := cli.NewKafkaTopicFlags(fs)
	embedded := fs.Bool("embedded-kafka", false, "start an embedded Kafka broker in this process instead of using --brokers")
	embeddedAddr := fs.String("embedded-kafka-addr", "", "with --embedded-kafka: its listen address, e.g. 127.0.0.1:9092, so that other processes (km0 lag, km0 dlq) can reach it (default a free port on 127.0.0.1, printed)")
	events := cli.EventsFlag(fs)
	eventsExchange := fs.String("events-exchange", cmp.Or(os.Getenv("KM0_EVENTS_EXCHANGE"), system.EventsExchangeDefault), "RabbitMQ topic exchange of the events --events puts there (default $KM0_EVENTS_EXCHANGE, else "+system.EventsExchangeDefault+")")
	eventsPrefix := fs.String("events-queue-prefix", os.Getenv("KM0_EVENTS_QUEUE_PREFIX"), "put this before the name of every RabbitMQ queue of the events, e.g. staging. (default $KM0_EVENTS_QUEUE_PREFIX; give every process the same)")
	amqpURL := cli.SecretString(fs, "amqp-url", os.Getenv("KM0_AMQP_URL"), "RabbitMQ URL for request/reply and for the events --events puts there (default $KM0_AMQP_URL; empty: request/reply over Kafka, and with --events rabbitmq the local guest broker)")
	amqpTLS := cli.AddAMQPTLSFlags(fs)
	authorize := fs.Bool("authorize", false, "comandes asks pagaments to authorise each order by request/reply, and pagaments charges only orders it approved (give every process the same; off by default in km0 up and km0 serve: orders follow the asynchronous flow alone and separate serve processes need no shared $"+requestreply.SigningKeyEnv+"; km0 demo turns it on to show request/reply)")
	acceptUnsigned := fs.Bool("accept-unsigned-requests", false, "start pagaments, or comandes with --authorize, without $"+requestreply.SigningKeyEnv+": authorisation requests and replies go unsigned and anyone who can publish to "+pagaments.AuthQueue+" is trusted (logged at start and shown in /salut; km0 up instead generates a key for its own process)")
	gateway := cli.SecretString(fs, "gateway-url", os.Getenv("KM0_PASSARELLA_URL"), "payment gateway URL (default: start the simulated one)")
	httpAddrs := fs.String("http-addr", "", "listen addresses of the HTTP APIs: NAME=ADDR,... e.g. comandes=:8080,analitica=:8081 (default a free port each)")
	allowedHosts := fs.String("http-allowed-hosts", os.Getenv(hostguard.AllowedHostsEnv), "Host names the HTTP APIs answer besides their listen address: NAME or NAME:PORT,... or * for any (default $"+hostguard.AllowedHostsEnv+"; loopback servers answer localhost, 127.0.0.1 and [::1])")
	deliveryTime := fs.Duration("delivery-time", repartiment.DeliveryTimeDefault, "repartiment: how long a courier stays busy with one delivery")
	assignInterval := fs.Duration("assign-interval", system.AssignIntervalDefault, "repartiment: period of the loop that assigns pending deliveries")
	pruneOlder := fs.Duration("prune-older-than", 0, "each service's relay deletes its published outbox rows older than this, a pass every minute (default 0: off; keep it at least your replay window)")
	deletePublished := fs.Bool("delete-published", false, "each service's relay deletes each outbox row as soon as the broker confirmed it, instead of setting publicat_en: the outboxes keep only pending rows and nothing can be replayed from them")
	relayMode := fs.String("relay", system.RelayPolling, "how each service's relay finds its outbox rows: polling (claim them from the table) or cdc (stream the inserts from the WAL; the server needs wal_level = logical and the REPLICATION privilege; slots km0_<database>_outbox)")
	outboxMode := fs.String("outbox", string(outbox.ModeTable), "where the services write their events: table (outbox rows) or wal (WAL messages, no rows; implies --relay cdc; each service's slot is created at start, before anything is written; see docs/cdc.md)")
	consoleAddr := fs.String("console-addr", "", "also serve the operator console here, e.g. 127.0.0.1:8090 (the dead letters of Kafka's DLQ topics and of the consumers' RabbitMQ DLQs, by --events, indexed in km0_dlq on the --database-url server; lag, health; token $"+dlqcli.AdminTokenEnv+", unset: one for the run in a 0600 file whose path is printed)")
	alerts := addAlertFlags(fs, "with --console-addr")
	dbSuffix := fs.String("database-suffix", "", "name the databases km0_<service>_<suffix> instead of km0_<service> (lower-case letters, digits, _)")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *outboxMode == string(outbox.ModeWAL) && !flagSet(fs, "relay") {
		*relayMode = system.RelayCDC // --outbox wal implies --relay cdc
	}
	if err := alerts.check(*consoleAddr != "", "--console-addr"); err != nil {
		return err
	}
	addrs, err := parseHTTPAddrs(*httpAddrs, services, *gateway)
	if err != nil {
		return err
	}
	if strings.Trim(*dbSuffix, "abcdefghijklmnopqrstuvwxyz0123456789_") != "" {
		return fmt.Errorf("--database-suffix %q: use lower-case letters, digits and _ only", *dbSuffix)
	}
	if serviceURL != nil && *serviceURL != "" {
		own[services[0]] = *serviceURL
	}
	for _, s := range services {
		if *dbURL == "" && own[s] == "" {
			return fmt.Errorf("no database for %s: set %s (its own database) or pass --database-url / set KM0_DATABASE_URL (an admin URL; km0_<service> databases are created on that server)", s, serviceDatabaseEnv(s))
		}
	}
	if *dbURL != "" {
		// A malformed URL, a missing database or a refused login is named
		// here, before anything starts; a server that does not answer is
		// left to system.Start, which names the service that needed it.
		pool, err := cli.OpenPool(ctx, *dbURL, 1)
		var refused *cli.ConnectRefusal
		if errors.As(err, &refused) || errors.Is(err, cli.ErrMalformedURL) {
			return err
		}
		if pool != nil {
			pool.Close()
		}
	}
	for _, s := range slices.Sorted(maps.Keys(own)) {
		// A service's own database is used as is, never created: one
		// that does not exist, or refuses the login, is named here too.
		pool, err := cli.OpenPool(ctx, own[s], 1)
		var refused *cli.ConnectRefusal
		if errors.As(err, &refused) {
			return fmt.Errorf("%s: %w", s, err)
		}
		if pool != nil {
			pool.Close()
		}
	}
	topicRenames, err := parseRenames("--topics", *topics)
	if err != nil {
		return err
	}
	groupRenames, err := parseRenames("--groups", *groups)
	if err != nil {
		return err
	}
	evBroker, evTopics, err := system.ParseEvents(*events)
	if err != nil {
		return fmt.Errorf("--events: %w", err)
	}
	cfg := system.Config{Events: evBroker, EventsByTopic: evTopics, AMQPURL: *amqpURL, EventsExchange: *eventsExchange, EventsQueuePrefix: *eventsPrefix}
	if cfg.NeedsRabbitMQ() && cfg.AMQPURL == "" {
		cfg.AMQPURL = amqp.URLDefault
	}
	amqpTLSCfg, err := amqpTLS.Config()
	if err != nil {
		return err
	}
	if *embeddedAddr != "" && !*embedded {
		return errors.New("--embedded-kafka-addr needs --embedded-kafka")
	}
	var brokerList []string
	switch {
	case !cfg.NeedsKafka() && !*embedded:
	case *embedded:
		b, err := kafkaembed.Start(kafkaembed.Config{Addr: *embeddedAddr, Topics: system.DomainTopics()})
		if err != nil {
			return err
		}
		defer b.Close()
		brokerList = b.Addrs()
	default:
		if brokerList, err = cli.RequireBrokers(*brokers); err != nil {
			return fmt.Errorf("%w (or pass --embedded-kafka)", err)
		}
	}
	remote := brokerList
	if *embedded {
		remote = nil // the embedded broker speaks plaintext
	}
	kopts, err := ksec.Opts(ctx, remote, cli.Logger())
	if err != nil {
		return err
	}
	topicSettings, err := ktopics.Settings(*embedded)
	if err != nil {
		return err
	}
	key, err := signingKey(name, *acceptUnsigned)
	if err != nil {
		return err
	}
	startCfg := system.Config{SigningKey: key, AcceptUnsignedRequests: *acceptUnsigned, DatabaseURL: *dbURL, DatabaseSuffix: *dbSuffix, DatabaseURLs: own, Topics: topicRenames, Groups: groupRenames,
		Brokers: brokerList, KafkaOpts: kopts, TopicSettings: topicSettings, Events: cfg.Events, EventsByTopic: cfg.EventsByTopic, EventsExchange: cfg.EventsExchange, EventsQueuePrefix: cfg.EventsQueuePrefix, Services: services, AMQPURL: cfg.AMQPURL, AMQPTLS: amqpTLSCfg, Authorize: *authorize, GatewayURL: *gateway, HTTPAddrs: addrs,
		AllowedHosts: strings.Split(*allowedHosts, ","),
		OutboxMode:   outbox.Mode(*outboxMode),
		DeliveryTime: *deliveryTime, AssignInterval: *assignInterval, RelayPruneOlderThan: *pruneOlder, RelayDeletePublished: *deletePublished, RelayMode: *relayMode, Logger: cli.Logger()}
	sys, err := startSystem(ctx, name, startCfg, remote, cli.Logger())
	if err != nil || sys == nil {
		return err // sys == nil: stopped while waiting for Kafka
	}
	defer sys.Close()
	fmt.Printf("km0 %s: running %s (%s)\n", name, strings.Join(services, ", "), transports(sys, brokerList))
	all := sys.Addrs()
	keys := make([]string, 0, len(all))
	for k := range all {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Printf("  %-12s %s\n", k, all[k])
	}
	for _, r := range []struct {
		what string
		m    map[string]string
	}{{"topic", topicRenames}, {"group", groupRenames}} {
		for _, k := range slices.Sorted(maps.Keys(r.m)) {
			fmt.Printf("  %s %s → %s\n", r.what, k, r.m[k])
		}
	}
	if *consoleAddr != "" {
		stop, err := systemConsole(ctx, sys, *consoleAddr, *dbURL, *dbSuffix, brokerList, false, alerts.rule(), os.Stdout, "km0 "+name, cli.Logger())
		if err != nil {
			return err
		}
		defer stop()
	}
	<-ctx.Done()
	fmt.Printf("km0 %s: stopping\n", name)
	return nil
}

// signingKey is the request/reply signing key of km0 NAME: $KM0_RR_HMAC_KEY,
// or for km0 up (comandes and pagaments in one process) a random one it
// generates when none is set and unsigned requests are not accepted. nil
// lets system.Start read the environment and refuse a process that needs a
// key without one.
func signingKey(name string, acceptUnsigned bool) ([]byte, error) {
	if key := requestreply.SigningKeyFromEnv(); key != nil || name != "up" || acceptUnsigned {
		return key, nil
	}
	return newSigningKey()
}

// newSigningKey returns a random key of requestreply.MinKeyBytes bytes,
// hex-encoded (so it can travel in the environment).
func newSigningKey() ([]byte, error) {
	b := make([]byte, requestreply.MinKeyBytes)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("generate a request/reply signing key: %w", err)
	}
	return []byte(hex.EncodeToString(b)), nil
}

// transports names where the events and request/reply travel.
func transports(sys *system.System, brokers []string) string {
	by := map[string][]string{}
	for t, b := range sys.EventsBroker() {
		by[b] = append(by[b], t)
	}
	var parts []string
	switch {
	case len(by[system.EventsRabbitMQ]) == 0:
		parts = append(parts, "events on Kafka")
	case len(by[system.EventsKafka]) == 0:
		parts = append(parts, "events on RabbitMQ")
	default:
		slices.Sort(by[system.EventsRabbitMQ])
		parts = append(parts, "events on Kafka, "+strings.Join(by[system.EventsRabbitMQ], ", ")+" on RabbitMQ")
	}
	parts = append(parts, "request/reply on "+sys.RequestReplyTransport())
	if len(brokers) > 0 {
		parts = append(parts, "Kafka "+strings.Join(brokers, ","))
	}
	return strings.Join(parts, "; ")
}

// serviceDatabaseEnv is the environment variable of service's own database
// URL: KM0_<SERVICE>_DATABASE_URL.
func serviceDatabaseEnv(service string) string {
	return "KM0_" + strings.ToUpper(service) + "_DATABASE_URL"
}

// parseRenames parses OLD=NEW,... (system.Start checks the names).
func parseRenames(flag, s string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" || v == "" {
			return nil, fmt.Errorf("%s %q: want CONTRACT=NAME", flag, kv)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("%s: %s renamed twice", flag, k)
		}
		out[k] = v
	}
	return out, nil
}

// startSystem is system.Start, retried while the Kafka brokers (remote)
// cannot be reached, as km0 relay does: a dial error of Kafka at start is a
// warning naming the brokers and the cause, repeated with a growing wait
// (1 s, doubling, at most 30 s), not an exit. Every other error, a refused
// TLS or SASL login of Kafka among them, is returned at once, and the names
// and flags are checked (by system.Start) before Kafka is dialled. It
// returns nil, nil if ctx ends while waiting.
func startSystem(ctx context.Context, name string, cfg system.Config, remote []string, log *slog.Logger) (*system.System, error) {
	for wait := time.Second; ; wait = min(2*wait, 30*time.Second) {
		sys, err := system.Start(ctx, cfg)
		if err == nil || len(remote) == 0 || !kafkaUnreachable(err) {
			return sys, err
		}
		if ctx.Err() != nil {
			return nil, nil
		}
		log.Warn("km0 "+name+": Kafka does not answer; retrying", "brokers", strings.Join(remote, ","), "err", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return nil, nil
		case <-time.After(wait):
		}
	}
}

// kafkaUnreachable reports whether err is a failure to dial (a network
// error that is not PostgreSQL's connect error nor RabbitMQ's), not a
// refusal: a broker that answered and refused (TLS, SASL, a topic) is not
// retried.
func kafkaUnreachable(err error) bool {
	var op *net.OpError
	var pg *pgconn.ConnectError
	return errors.As(err, &op) && !errors.As(err, &pg) && !errors.Is(err, amqp.ErrBrokerUnavailable) && !errors.Is(err, kafka.ErrSecurity)
}
