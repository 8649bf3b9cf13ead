package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/consolesrv"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/hostguard"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay/cdc"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/amqp/amqplag"
)

func init() {
	register(&command{name: "console", summary: "the operator console in the browser: dead letters by failure group (read, replay, purge), lag and health", run: runConsole})
}

// consoleAddrDefault is where km0 console listens: loopback only.
const consoleAddrDefault = "127.0.0.1:8090"

// lagFlags are the flags of what km0 console and km0 lag measure besides
// what the DLQ flags name.
type lagFlags struct {
	outboxes, services        *mapFlag
	groups, management        *string
	outboxSchema, outboxTable *string
	outboxMode, slot          *string
	interval, alertFor        *time.Duration
	maxLag                    *thresholdFlag[int64]
	maxAge                    *thresholdFlag[time.Duration]
	allGroups                 *bool
}

// rule is the lag.Rule of f's thresholds.
func (f *lagFlags) rule() lag.Rule {
	r := lag.Rule{MaxLag: f.maxLag.v, LagSet: f.maxLag.set, MaxAge: f.maxAge.v, AgeSet: f.maxAge.set, AllGroups: *f.allGroups}
	if f.alertFor != nil {
		r.For = *f.alertFor
	}
	return r
}

// thresholdFlag is a lag threshold flag: absent is off, and any value given,
// 0 included, applies (--max-lag 0: fully caught up). Negative is refused.
type thresholdFlag[T int64 | time.Duration] struct {
	v   T
	set bool
}

func (f *thresholdFlag[T]) String() string {
	if f == nil || !f.set {
		return ""
	}
	if d, ok := any(f.v).(time.Duration); ok {
		return d.String()
	}
	return strconv.FormatInt(int64(f.v), 10)
}

func (f *thresholdFlag[T]) Set(s string) error {
	var v T
	switch p := any(&v).(type) {
	case *time.Duration:
		d, err := time.ParseDuration(s)
		if err != nil {
			return errors.New("not a duration (e.g. 30s, 5m)")
		}
		*p = d
	case *int64:
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return errors.New("not an integer")
		}
		*p = n
	}
	if v < 0 {
		return errors.New("must not be negative")
	}
	f.v, f.set = v, true
	return nil
}

func addLagFlags(fs *flag.FlagSet, alerts bool) *lagFlags {
	f := &lagFlags{outboxes: &mapFlag{secret: true, name: "outbox"}, services: &mapFlag{}}
	fs.Var(f.outboxes, "outbox", "an outbox to watch: NAME=DATABASE_URL (repeatable; the table is --outbox-schema.--outbox-table; default $"+outboxesEnv+
		", NAME=DATABASE_URL entries separated by newlines or ;); on the command line it shows in ps: prefer $"+outboxesEnv+" or --outbox-file")
	fs.Func("outbox-file", "read outboxes to watch from the file at `PATH`: one NAME=DATABASE_URL a line, # comments (with --outbox: both; make it readable by this user only)", f.outboxes.setFile)
	f.outboxes.loadEnv(outboxesEnv) // after fs.Var: --help prints no default
	f.outboxSchema = fs.String("outbox-schema", migrate.SchemaDefault, "PostgreSQL schema of the --outbox tables")
	f.outboxTable = fs.String("outbox-table", migrate.OutboxDefault, "table name of the --outbox tables")
	f.outboxMode = fs.String("outbox-mode", string(outbox.ModeTable), "table: the --outbox outboxes' pending rows; wal: they are WAL-mode outboxes (km0 migrate --outbox-mode wal), measured from their replication slot (unconfirmed bytes, retained WAL, the age of the oldest unconfirmed message)")
	f.slot = fs.String("slot", "", "--outbox-mode wal: the replication slot (default km0_wal_<database>_<schema>_<table>, km0 migrate's and the relay's default)")
	f.groups = fs.String("consumer-groups", "", "the system's Kafka consumer groups, comma separated, each reported even when the cluster does not list it (default: those the cluster lists of the services' groups, as $KM0_GROUPS renames them, and the DLQ indexer's "+kafkadlq.GroupDefault+")")
	f.allGroups = fs.Bool("all-groups", false, "also report the consumer groups of other Kafka clients (default: only the system's groups)")
	f.management = cli.SecretString(fs, "amqp-management-url", os.Getenv("KM0_AMQP_MANAGEMENT_URL"),
		"RabbitMQ management API, e.g. http://guest:guest@127.0.0.1:15672, for unacked counts (default $KM0_AMQP_MANAGEMENT_URL, else port 15672 of the AMQP URL's host with its credentials; \"off\": unacked unknown)")
	f.maxLag, f.maxAge = &thresholdFlag[int64]{}, &thresholdFlag[time.Duration]{}
	fs.Var(f.maxLag, "max-lag", "alert threshold: a group's lag, an outbox's pending rows or a queue's ready messages over this (0: any lag at all; default: off)")
	fs.Var(f.maxAge, "max-age", "alert threshold: a group's oldest unprocessed record or an outbox's oldest row older than this (0: any age at all; default: off)")
	if alerts {
		fs.Var(f.services, "service", "a service whose health to show: NAME=BASE_URL (GET BASE_URL/salut; repeatable)")
		f.interval = fs.Duration("lag-interval", lag.IntervalDefault, "time between two lag samples")
		f.alertFor = fs.Duration("alert-for", 5*time.Minute, "the webhook gets a lag alert once a threshold has been exceeded this long")
	}
	return f
}

// outboxesEnv is the environment form of --outbox: NAME=DATABASE_URL
// entries separated by newlines or semicolons (a ; inside a URL is %3B).
const outboxesEnv = "KM0_OUTBOXES"

// mapFlag is a repeatable NAME=VALUE flag.
type mapFlag struct {
	keys []string
	vals map[string]string
	// secret values are credentials (--outbox): a malformed one is reported
	// by check after parsing, not by Set, whose error flag prints with the
	// value; name is the flag's.
	secret bool
	name   string
	errs   []error
	// fromEnv: the entries come from the environment (loadEnv) and the
	// first of the command line replaces them; envErrs are theirs.
	fromEnv bool
	envErrs []error
}

func (m *mapFlag) String() string { return strings.Join(m.keys, ",") } // never the values: URLs hold passwords

// Set adds NAME=VALUE.
func (m *mapFlag) Set(v string) error {
	m.fromCommandLine()
	err := m.add(v)
	if err != nil && m.secret {
		m.errs = append(m.errs, fmt.Errorf("--%s: %w (the value is not shown: it may hold a password)", m.name, err))
		return nil
	}
	return err
}

// add adds NAME=VALUE; its errors never quote the value.
func (m *mapFlag) add(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if k, val = strings.TrimSpace(k), strings.TrimSpace(val); !ok || k == "" || val == "" {
		return errors.New("want NAME=VALUE")
	}
	if m.vals == nil {
		m.vals = map[string]string{}
	}
	if _, dup := m.vals[k]; dup {
		return fmt.Errorf("%s given twice", k)
	}
	m.keys = append(m.keys, k)
	m.vals[k] = val
	return nil
}

// fromCommandLine drops the entries of the environment at the first one of
// the command line.
func (m *mapFlag) fromCommandLine() {
	if m.fromEnv {
		m.keys, m.vals, m.fromEnv, m.envErrs = nil, nil, false, nil
	}
}

// loadEnv takes the entries of $env (newline or ; separated) as defaults.
func (m *mapFlag) loadEnv(env string) {
	m.fromEnv = true
	for i, e := range strings.FieldsFunc(os.Getenv(env), func(r rune) bool { return r == '\n' || r == ';' }) {
		if e = strings.TrimSpace(e); e == "" {
			continue
		}
		if err := m.add(e); err != nil {
			m.envErrs = append(m.envErrs, fmt.Errorf("$%s entry %d: %w (the value is not shown: it may hold a password)", env, i+1, err))
		}
	}
}

// setFile adds the entries of the file at path: one NAME=VALUE a line,
// blank lines and # comments skipped. Errors name the path and the line,
// never the content.
func (m *mapFlag) setFile(path string) error {
	m.fromCommandLine()
	b, err := cli.ReadSmallFile(path)
	if err != nil {
		return err
	}
	for i, line := range strings.Split(string(b), "\n") {
		if line = strings.TrimSpace(line); line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if err := m.add(line); err != nil {
			return fmt.Errorf("%s line %d: %w", path, i+1, err)
		}
	}
	return nil
}

func (m *mapFlag) Check() error {
	return errors.Join(append(m.errs, m.envErrs...)...)
}

func runConsole(ctx context.Context, args []string) error {
	return consoleCmd(ctx, os.Stdout, os.Stderr, args)
}

func consoleCmd(ctx context.Context, out, errOut io.Writer, args []string) error {
	c := &dlqcli.CLI{Out: out, ErrOut: errOut, In: strings.NewReader(""), Now: time.Now}
	fs, o := c.FlagsFor("console", "serve the operator console (dead letters by failure group: read, replay, purge; lag and health), index every new dead letter and alert on it, as km0 dlq index")
	addr := fs.String("http-addr", consoleAddrDefault, "listen address of the console (loopback by default; the Host header is checked)")
	allowed := fs.String("http-allowed-hosts", os.Getenv(hostguard.AllowedHostsEnv), "Host names the console answers besides its listen address: NAME or NAME:PORT,... (default $"+hostguard.AllowedHostsEnv+")")
	interval := fs.Duration("interval", 2*time.Second, "RabbitMQ: time between two syncs of the DLQ queues")
	retention := fs.Duration("retention", inbox.RetentionDefault, "the consumers' idempotency retention: replays refuse older letters unless forced")
	lf := addLagFlags(fs, true)
	serviceDBs := &mapFlag{secret: true, name: "service-db"}
	fs.Var(serviceDBs, "service-db", "a service's own database: NAME=DATABASE_URL (repeatable; default $"+serviceDBsEnv+
		"): its blocked keys (per-key order) and the pause of its consumer groups; on the command line it shows in ps: prefer $"+serviceDBsEnv+" or --service-db-file")
	fs.Func("service-db-file", "read the services' databases from the file at `PATH`: one NAME=DATABASE_URL a line, # comments", serviceDBs.setFile)
	serviceDBs.loadEnv(serviceDBsEnv)
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *retention <= 0 || *interval <= 0 {
		return errors.New("--retention and --interval must be positive")
	}
	reg := prometheus.NewRegistry() // the console's /metrics: dead letters and lag
	env, err := c.Open(ctx, o, reg, false)
	if err != nil {
		return err
	}
	defer env.Close()
	lcfg, closeLag, err := lagConfig(ctx, *o.Brokers, *o.AMQPURL, o.AMQPTLS, o.QueueNames(), *o.Group, lf)
	if err != nil {
		return err
	}
	defer closeLag()
	lcfg.ClientOpts = env.KafkaOpts
	sdbs, closeSDBs, err := serviceDatabases(serviceDBs)
	if err != nil {
		return err
	}
	defer closeSDBs()
	broker := "Kafka"
	if env.Rabbit {
		broker = "RabbitMQ"
	}
	_, stop, err := consolesrv.Serve(ctx, consolesrv.Parts{Addr: *addr, Allowed: strings.Split(*allowed, ","), Token: os.Getenv(dlqcli.AdminTokenEnv),
		Source: env.Svc, Broker: broker, Alerter: env.Alerter, Lag: lcfg, Interval: *lf.interval,
		Rule:     lf.rule(),
		Services: services(lf.services), Registry: reg, AllGroups: *lf.allGroups, Out: c.ErrOut, Name: "km0 console", Retention: *retention,
		KeyOrder: env.Pool, KeyOrderSchema: *o.Schema, ServiceDBs: sdbs})
	if err != nil {
		return err
	}
	defer stop()
	if env.Rabbit {
		return dlqcli.SyncEvery(ctx, env.Svc, *interval, cli.Logger())
	}
	ix, err := kafkadlq.NewIndexer(kafkadlq.IndexerConfig{Kafka: env.Kafka, Store: env.Store, Alerter: env.Alerter})
	if err != nil {
		return err
	}
	return ix.Run(ctx)
}

// lagConfig builds what km0 console and km0 lag measure from the flags: the
// outboxes of --outbox, the groups of --brokers (--consumer-groups, else the
// system's: systemGroups with dlqGroup; others with --all-groups), the
// queues of --queue.
func lagConfig(ctx context.Context, brokers, amqpURL string, amqpTLS *cli.AMQPTLSFlags, queues []string, dlqGroup string, lf *lagFlags) (consolesrv.LagTargets, func(), error) {
	cfg := consolesrv.LagTargets{Brokers: splitList(brokers), Config: lag.Config{Groups: splitList(*lf.groups), AllGroups: *lf.allGroups,
		ManagementURL: *lf.management, Logger: cli.Logger()}}
	if len(cfg.Groups) == 0 {
		groups, err := systemGroups(os.Getenv("KM0_GROUPS"), dlqGroup)
		if err != nil {
			return cfg, nil, err
		}
		cfg.Groups, cfg.OmitUnlisted = groups, true
	}
	var closers []func()
	closeAll := func() {
		for _, c := range closers {
			c()
		}
	}
	wal := *lf.outboxMode == string(outbox.ModeWAL)
	switch {
	case !wal && *lf.outboxMode != string(outbox.ModeTable):
		return cfg, nil, fmt.Errorf("--outbox-mode %q: want %s or %s", *lf.outboxMode, outbox.ModeTable, outbox.ModeWAL)
	case *lf.slot != "" && !wal:
		return cfg, nil, errors.New("--slot applies to --outbox-mode wal only")
	case *lf.slot != "" && !cdc.ValidSlot(*lf.slot):
		return cfg, nil, fmt.Errorf("--slot %q: a slot name is 1 to 63 lower-case letters, digits and underscores", *lf.slot)
	}
	for _, name := range lf.outboxes.keys {
		// Not pinged: a database that does not answer yet (or does not
		// exist yet) is an error of that outbox on every sample, retried,
		// not a reason to quit.
		pool, err := lazyPool(lf.outboxes.vals[name], 2)
		if err != nil {
			closeAll()
			return cfg, nil, fmt.Errorf("--outbox %s: %w", name, err)
		}
		closers = append(closers, pool.Close)
		cfg.Outboxes = append(cfg.Outboxes, lag.Outbox{Name: name, DB: pool, Names: migrate.Names{Schema: *lf.outboxSchema, Outbox: *lf.outboxTable},
			WAL: wal, Slot: *lf.slot})
	}
	if qs := queues; len(qs) > 0 {
		tlsCfg, err := amqpTLS.Config()
		if err != nil {
			closeAll()
			return cfg, nil, err
		}
		// The management API is reached with the broker's TLS settings.
		cfg.HTTPClient = cli.ManagementClient(tlsCfg)
		conn, err := amqp.Dial(ctx, amqp.Config{URL: amqpURL, Name: "km0 lag", Logger: cli.Logger(), TLS: tlsCfg})
		if err != nil {
			closeAll()
			return cfg, nil, err
		}
		closers = append(closers, func() { _ = conn.Close() })
		cfg.RabbitMQ, cfg.Queues = amqplag.New(conn), qs
		mgmt, vhost, err := amqplag.ManagementURLFor(amqpURL)
		if err != nil {
			closeAll()
			return cfg, nil, err
		}
		cfg.VHost = vhost
		switch *lf.management {
		case "off":
			cfg.ManagementURL = ""
		case "":
			// The plugin's default listener: unacked counts without a flag
			// when it runs; a note, not an error, when it does not.
			cfg.ManagementURL, cfg.ManagementBestEffort = mgmt, true
		}
	}
	return cfg, closeAll, nil
}

// systemGroups are the consumer groups of the system: each service's
// consumer group (system.ConsumerNames, as $KM0_GROUPS renames
// them for km0 up) and the DLQ indexer's dlqGroup.
func systemGroups(renames, dlqGroup string) ([]string, error) {
	rn, err := parseRenames("$KM0_GROUPS", renames)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, n := range system.ConsumerNames {
		out = append(out, cmp.Or(rn[n], n))
	}
	return append(out, cmp.Or(dlqGroup, kafkadlq.GroupDefault)), nil
}

func splitList(s string) []string {
	var out []string
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

func services(m *mapFlag) []console.Service {
	var out []console.Service
	for _, k := range m.keys {
		out = append(out, console.Service{Name: k, URL: m.vals[k]})
	}
	return out
}

// serviceDBsEnv is the environment form of --service-db: NAME=DATABASE_URL
// entries separated by newlines or semicolons.
const serviceDBsEnv = "KM0_SERVICE_DBS"

// lazyPool returns a pool of url that connects on first use: a database
// that does not answer (or does not exist) yet fails each query, and a
// later one succeeds once it does. Only a malformed URL is an error (never
// quoted: it may hold a password).
func lazyPool(url string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, errors.New("invalid database URL (not shown: it may hold a password)")
	}
	cfg.MaxConns = maxConns
	return pgxpool.NewWithConfig(context.Background(), cfg)
}

// serviceDatabases opens the databases of --service-db (lazily, as the
// outboxes) with each service's consumer groups (system.ConsumerNames of
// the service, as $KM0_GROUPS renames them).
func serviceDatabases(m *mapFlag) ([]console.ServiceDB, func(), error) {
	rn, err := parseRenames("$KM0_GROUPS", os.Getenv("KM0_GROUPS"))
	if err != nil {
		return nil, nil, err
	}
	var out []console.ServiceDB
	var pools []*pgxpool.Pool
	closeAll := func() {
		for _, p := range pools {
			p.Close()
		}
	}
	for _, name := range m.keys {
		pool, err := lazyPool(m.vals[name], 2)
		if err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("--service-db %s: %w", name, err)
		}
		pools = append(pools, pool)
		out = append(out, console.ServiceDB{Name: name, DB: pool, Groups: serviceGroups(name, rn)})
	}
	return out, closeAll, nil
}

// serviceGroups are the consumer groups of service among
// system.ConsumerNames (named service.*), renamed by rn.
func serviceGroups(service string, rn map[string]string) []string {
	var out []string
	for _, n := range system.ConsumerNames {
		if strings.HasPrefix(n, service+".") {
			out = append(out, cmp.Or(rn[n], n))
		}
	}
	return out
}
