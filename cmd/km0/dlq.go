package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/km0/km0/internal/hostguard"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/amqpdlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

func init() {
	register(&command{name: "dlq", summary: "list, show, replay and purge dead letters; run the DLQ indexer (km0 dlq help)", run: runDLQ})
}

const dlqUsage = `usage: km0 dlq <command> [flags]   (km0 dlq <command> --help for its flags)

Every command first syncs the PostgreSQL index of dead letters with the DLQ
topics (reads them up to their current end), so nothing shown is stale.

RabbitMQ: pass --queue Q (the work queues whose Q.dlq to operate; the URL is
--amqp-url, else $KM0_AMQP_URL, else the local guest broker). The sync moves
each dead letter off the broker into the index (acked only after the index
committed it); from then on the index holds it and replay republishes from it.

commands:
  ls       dead letters grouped by topic and motiu, then the rows
  show     one letter: fields, headers and the envelope (raw bytes shown safely)
  replay   republish letters to their original topic (same key and id_esdeveniment)
  sequence a key blocked by a per-key order consumer: its head and the messages behind it;
           --replay replays it as one (the head; its consumer releases the rest in order)
  purge    mark letters purged (Kafka cannot delete single records; see --delete-records)
  audit    the audit log: every replay, purge and edit, who ran it, when, on which letters
  index    run the indexer: index every new dead letter, alert, serve /metrics and the admin API
           (RabbitMQ: syncs every --interval)
`

// runDLQ is the `km0 dlq` command.
func runDLQ(ctx context.Context, args []string) error {
	fi, err := os.Stdin.Stat()
	tty := err == nil && fi.Mode()&os.ModeCharDevice != 0
	return (&dlqCLI{out: os.Stdout, errOut: os.Stderr, in: os.Stdin, tty: tty, now: time.Now}).run(ctx, args)
}

// dlqCLI holds the process's streams so tests can run the commands.
type dlqCLI struct {
	out, errOut io.Writer
	in          io.Reader
	tty         bool // stdin is a terminal: purge may ask for confirmation
	now         func() time.Time
}

func (c *dlqCLI) run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		fmt.Fprint(c.errOut, dlqUsage)
		return errUsage
	}
	switch args[0] {
	case "ls":
		return c.ls(ctx, args[1:])
	case "show":
		return c.show(ctx, args[1:])
	case "replay":
		return c.replay(ctx, args[1:])
	case "sequence":
		return c.sequence(ctx, args[1:])
	case "purge":
		return c.purge(ctx, args[1:])
	case "index":
		return c.index(ctx, args[1:])
	case "audit":
		return c.auditLog(ctx, args[1:])
	case "help", "-h", "--help":
		fmt.Fprint(c.out, dlqUsage)
		return nil
	}
	fmt.Fprintf(c.errOut, "km0 dlq: unknown command %q\n\n%s", args[0], dlqUsage)
	return errUsage
}

// dlqOpts are the flags every dlq command shares.
type dlqOpts struct {
	dbURL, brokers, schema, topics, group, webhook *string
	amqpURL                                        *string
	amqpTLS                                        *amqpTLSFlags
	queues                                         *listFlag
	syncTimeout                                    *time.Duration
	json                                           *bool
	kafka                                          *kafkaSecurity
	fs                                             *flag.FlagSet
}

// rabbit reports whether the RabbitMQ backend is selected: --queue given, or
// --amqp-url or --amqp-url-file set on the command line ($KM0_AMQP_URL alone
// does not select it).
func (o *dlqOpts) rabbit() bool {
	set := len(*o.queues) > 0
	o.fs.Visit(func(f *flag.Flag) { set = set || f.Name == "amqp-url" || f.Name == "amqp-url-file" })
	return set
}

// queueNames splits the --queue values on commas.
func (o *dlqOpts) queueNames() []string {
	var out []string
	for _, v := range *o.queues {
		out = append(out, kafka.SplitBrokers(v)...)
	}
	return out
}

func (c *dlqCLI) flags(name, summary string) (*flag.FlagSet, *dlqOpts) {
	fs, o := c.flagsFor("dlq "+name, summary)
	o.json = fs.Bool("json", false, "print JSON for scripts")
	return fs, o
}

// flagsFor registers the flags every dlq command shares (but --json) on a
// flag set named command; km0 console uses them too.
func (c *dlqCLI) flagsFor(command, summary string) (*flag.FlagSet, *dlqOpts) {
	fs := newFlags(command, summary)
	fs.SetOutput(c.errOut)
	o := &dlqOpts{
		dbURL:   databaseURLFlag(fs),
		brokers: brokersFlag(fs),
		kafka:   kafkaSecurityFlags(fs),
		schema:  fs.String("schema", migrate.SchemaDefault, "PostgreSQL schema of the index table cartes_mortes"),
		topics: fs.String("topics", "", "DLQ topics, comma separated (default: every topic matching "+
			kafkadlq.TopicPatternDefault+")"),
		group:       fs.String("group", kafkadlq.GroupDefault, "consumer group whose offsets mark what is indexed"),
		webhook:     secretString(fs, "webhook", os.Getenv("KM0_DLQ_WEBHOOK"), "URL that gets a JSON notice per new dead letter (default $KM0_DLQ_WEBHOOK)"),
		syncTimeout: fs.Duration("sync-timeout", dlq.SyncTimeoutDefault, "how long reading the DLQ topics may take"),
		queues:      &listFlag{},
		fs:          fs,
	}
	o.amqpURL = secretString(fs, "amqp-url", os.Getenv("KM0_AMQP_URL"), "RabbitMQ URL: operate the DLQ queues of --queue (default $KM0_AMQP_URL, else the local guest broker)")
	o.amqpTLS = addAMQPTLSFlags(fs)
	fs.Var(o.queues, "queue", "RabbitMQ work queue whose <queue>.dlq to operate (repeatable or comma separated); selects RabbitMQ")
	return fs, o
}

// dlqEnv is an open Source and how to close it. svc is a dlq.Service over
// the Kafka backend or, with --queue/--amqp-url, the RabbitMQ one; every
// command and the admin API use it unchanged.
type dlqEnv struct {
	svc     dlq.Source
	store   *dlq.Store
	pool    *pgxpool.Pool     // the index's database (also the consumers' keyorder tables)
	backend *kafkadlq.Backend // nil with RabbitMQ
	rabbit  bool
	kcfg    kafkadlq.Config
	kopts   []kgo.Opt // the Kafka security of --brokers, for every Kafka client
	alerter *dlq.Alerter
	close   func()
}

// open connects, applies the dlq migrations, and syncs the index.
func (c *dlqCLI) open(ctx context.Context, o *dlqOpts, reg prometheus.Registerer, sync bool) (*dlqEnv, error) {
	var brokers []string
	var err error
	if !o.rabbit() {
		brokers, err = requireBrokers(*o.brokers)
	} else if len(o.queueNames()) == 0 {
		err = errors.New("--amqp-url needs --queue: the work queues whose <queue>.dlq to operate")
	}
	if err != nil {
		return nil, err
	}
	pool, err := openPool(ctx, *o.dbURL, 4)
	if err != nil {
		return nil, err
	}
	env := &dlqEnv{close: pool.Close, pool: pool}
	fail := func(err error) (*dlqEnv, error) { env.close(); return nil, err }
	if _, err := migrate.Up(ctx, pool, migrate.Names{Schema: *o.schema}, dlq.Migrations); err != nil {
		return fail(err)
	}
	log := logger()
	if bs := kafka.SplitBrokers(*o.brokers); len(bs) > 0 {
		if env.kopts, err = o.kafka.opts(ctx, bs, log); err != nil {
			return fail(err)
		}
	}
	var backend dlq.Backend
	if o.rabbit() {
		env.rabbit = true
		tlsCfg, err := o.amqpTLS.config()
		if err != nil {
			return fail(err)
		}
		conn, err := amqp.Dial(ctx, amqp.Config{URL: *o.amqpURL, Name: "km0 dlq", Logger: log, TLS: tlsCfg})
		if err != nil {
			return fail(err) // names the URL without its password
		}
		ab, err := amqpdlq.New(amqpdlq.Config{Conn: conn, Queues: o.queueNames(), SyncTimeout: *o.syncTimeout, Logger: log})
		if err != nil {
			_ = conn.Close()
			return fail(err)
		}
		closePool := env.close
		env.close = func() { _ = ab.Close(); _ = conn.Close(); closePool() }
		backend = ab
	} else {
		env.kcfg = kafkadlq.Config{Brokers: brokers, Topics: kafka.SplitBrokers(*o.topics), Group: *o.group,
			SyncTimeout: *o.syncTimeout, Logger: log, ClientOpts: env.kopts}
		if env.backend, err = kafkadlq.New(env.kcfg); err != nil {
			return fail(err)
		}
		closePool := env.close
		env.close = func() { env.backend.Close(); closePool() }
		backend = env.backend
	}
	if reg == nil {
		reg = prometheus.NewRegistry() // a one-shot command exports no metrics
	}
	if env.alerter, err = dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, Logger: log, WebhookURL: *o.webhook}); err != nil {
		return fail(err)
	}
	closeBroker := env.close
	env.close = func() {
		// Give queued webhook notices a bounded chance to go out.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer cancel()
		_ = env.alerter.Close(cctx)
		closeBroker()
	}
	env.store = dlq.NewStore(pool, *o.schema)
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: env.store, Backend: backend, Alerter: env.alerter, Logger: log})
	if err != nil {
		return fail(err)
	}
	env.svc = svc
	if sync {
		res, err := env.svc.Sync(ctx)
		if err != nil {
			return fail(fmt.Errorf("sync the index: %w", err))
		}
		if len(res.New) > 0 {
			fmt.Fprintf(c.errOut, "km0 dlq: %d new dead letter(s) indexed\n", len(res.New))
		}
	}
	return env, nil
}

// filterFlags registers the selection flags of replay and purge.
type filterFlags struct {
	topic, motiu, since, until, group *string
	ids                               *listFlag
}

func addFilterFlags(fs *flag.FlagSet) *filterFlags {
	f := &filterFlags{
		topic: fs.String("topic", "", "only this topic: a DLQ topic (x.dlq) or an original topic (x)"),
		motiu: fs.String("reason", "", `only letters whose motiu (reason) starts with this, e.g. "permanent: esquema"`),
		since: fs.String("since", "", "only letters dead at or after this: RFC 3339, YYYY-MM-DD, or an age (36h, 7d)"),
		until: fs.String("until", "", "only letters dead before this (same forms as --since)"),
		group: fs.String("consumer", "", "only letters of this consumer (grup_consumidor: the Kafka group or RabbitMQ work queue)"),
		ids:   &listFlag{},
	}
	fs.Var(f.ids, "id", "only this letter (repeatable)")
	return f
}

func (f *filterFlags) filter(now time.Time) (dlq.Filter, error) {
	out := dlq.Filter{Topic: *f.topic, Reason: *f.motiu, Group: *f.group, IDs: *f.ids}
	var err error
	if out.Since, err = dlq.ParseTime(*f.since, now); err != nil {
		return out, err
	}
	out.Until, err = dlq.ParseTime(*f.until, now)
	return out, err
}

// addAllFlag registers --all on replay and purge and returns the check start
// runs: a selection without any filter is refused unless --all says it is
// meant to be every letter, and --all with a filter is refused as ambiguous.
func addAllFlag(fs *flag.FlagSet, verb string) func(*dlq.Filter) error {
	all := fs.Bool("all", false, "select every letter (required to "+verb+" without --id, --topic, --motiu, --since or --until)")
	return func(f *dlq.Filter) error {
		switch {
		case f.Empty() && !*all:
			return fmt.Errorf("refusing to %s every letter: no --id, --topic, --motiu, --consumer, --since or --until given; pass --all to select every letter", verb)
		case !f.Empty() && *all:
			return fmt.Errorf("--all selects every letter: give it without --id, --topic, --motiu, --since or --until")
		}
		return nil
	}
}

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// start parses args, builds the selection, then connects and syncs. check,
// if not nil, validates more flags before anything is opened.
func (c *dlqCLI) start(ctx context.Context, fs *flag.FlagSet, o *dlqOpts, ff *filterFlags, args []string,
	check func(*dlq.Filter) error) (dlq.Filter, *dlqEnv, error) {
	if err := parse(fs, args); err != nil {
		return dlq.Filter{}, nil, err
	}
	f, err := ff.filter(c.now())
	if err == nil && check != nil {
		err = check(&f)
	}
	if err != nil {
		return f, nil, err
	}
	env, err := c.open(ctx, o, nil, true)
	return f, env, err
}

func (c *dlqCLI) ls(ctx context.Context, args []string) error {
	fs, o := c.flags("ls", "list dead letters grouped by topic and motiu (counts), then the rows")
	ff := addFilterFlags(fs)
	state := fs.String("state", "pendent", "pendent, reproduida, purgada or totes")
	limit := fs.Int("limit", 200, "rows to print at most (0 = all); the counts always cover every letter")
	f, env, err := c.start(ctx, fs, o, ff, args, func(f *dlq.Filter) (err error) {
		f.Limit, f.Fold = *limit, true
		f.States, err = dlq.ParseState(*state)
		return err
	})
	if err != nil {
		return err
	}
	defer env.close()
	ls, err := env.svc.List(ctx, f)
	if err != nil {
		return err
	}
	if *o.json {
		return c.printJSON(dlq.ListingView(ls))
	}
	total := 0
	for _, g := range ls.Groups {
		total += g.Count
	}
	fmt.Fprintf(c.out, "%d dead letter(s) (estat %s)\n", total, cmp.Or(*state, "totes"))
	if ls.Refused > 0 {
		fmt.Fprintf(c.out, "%d letter(s) refused by the index, set aside in table %s (the error log names each)\n",
			ls.Refused, dlq.RefusedTable)
	}
	if total == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(c.out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nTOPIC\tGRUP_CONSUMIDOR\tMOTIU\tCARTES\tPRIMERA\tDARRERA")
	for _, g := range ls.Groups {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", g.Topic, dlq.Safe(g.Consumer), dlq.Safe(g.Class), g.Count, stamp(g.Oldest), stamp(g.Newest))
	}
	fmt.Fprintln(tw, "\nID\tMORTA_EN\tINTENTS\tESTAT\tTIPUS\tID_ESDEVENIMENT\tMOTIU")
	folded := 0
	for _, l := range ls.Letters {
		id := l.ID
		if l.Copies > 1 {
			id += fmt.Sprintf(" (+%d)", l.Copies-1)
			folded += l.Copies - 1
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\n", id, deadStamp(l), l.Attempts, l.State,
			orDash(dlq.Safe(l.Type)), orDash(dlq.Safe(l.EventID)), clip(dlq.Safe(l.Reason), 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if folded > 0 {
		fmt.Fprintf(c.out, "%d duplicate letter(s) folded: the same event dead in the same consumer more than once "+
			"(after a crash both retry copies of a message can reach it); replaying one is enough\n", folded)
	}
	if len(ls.Letters)+folded < total {
		fmt.Fprintf(c.out, "(%d of %d rows shown; --limit 0 shows all)\n", len(ls.Letters), total)
	}
	return nil
}

func (c *dlqCLI) show(ctx context.Context, args []string) error {
	fs, o := c.flags("show", "show one dead letter: fields, headers and the envelope")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: km0 dlq show [flags] ID   (ID as printed by km0 dlq ls: <dlq topic>/<partition>/<offset>)\n\nflags:\n")
		fs.PrintDefaults()
	}
	rest, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(rest) != 1 {
		fmt.Fprintln(c.errOut, "km0 dlq show: want exactly one letter ID")
		fs.Usage()
		return errUsage
	}
	env, err := c.open(ctx, o, nil, true)
	if err != nil {
		return err
	}
	defer env.close()
	l, err := env.svc.Get(ctx, rest[0])
	if err != nil {
		return err
	}
	if *o.json {
		return c.printJSON(dlq.View(l, true))
	}
	tw := tabwriter.NewWriter(c.out, 2, 4, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, v) }
	row("id", l.ID)
	row("estat", fmt.Sprintf("%s (reproduccions %d%s%s)", l.State, l.Replays, at(" darrera ", l.ReplayedAt), at(", purgada ", l.PurgedAt)))
	row("topic original", fmt.Sprintf("%s (partició %s, offset %s)", l.OriginalTopic, orDash(num(int64(l.OriginalPartition))), orDash(num(l.OriginalOffset))))
	row("motiu", dlq.Safe(l.Reason))
	row("intents", fmt.Sprint(l.Attempts))
	row("tipus", orDash(dlq.Safe(l.Type)))
	row("id_esdeveniment", orDash(dlq.Safe(l.EventID)))
	row("clau", fmt.Sprintf("%q", l.Key))
	row("primera fallada", orDash(stamp(l.FirstFailure)))
	row("data esdeveniment", orDash(stamp(l.EventTime)))
	row("morta en", deadStamp(l))
	row("grup consumidor", orDash(dlq.Safe(l.ConsumerGroup)))
	_ = tw.Flush()
	fmt.Fprintln(c.out, "\ncapçaleres:")
	for _, h := range l.Headers {
		fmt.Fprintf(c.out, "  %s: %s\n", dlq.Safe(h.Key), dlq.Safe(h.Value))
	}
	text, isJSON := dlq.PrettyValue(l.Value, 0)
	_, envErr := l.Envelope()
	switch {
	case envErr == nil:
		fmt.Fprintf(c.out, "\nenvolupant:\n%s\n", text)
	case isJSON:
		fmt.Fprintf(c.out, "\nvalor (JSON, but not a valid envelope: %s):\n%s\n", dlq.Safe(envErr.Error()), text)
	default:
		fmt.Fprintf(c.out, "\nvalor (%d bytes, not JSON: %s), escaped:\n%s\n", len(l.Value), dlq.Safe(envErr.Error()), text)
	}
	return nil
}

func (c *dlqCLI) replay(ctx context.Context, args []string) error {
	fs, o := c.flags("replay", "republish dead letters to their original topic with the same key, value and id_esdeveniment")
	ff := addFilterFlags(fs)
	dry := fs.Bool("dry-run", false, "say what would be replayed; publish and mark nothing")
	force := fs.Bool("force", false, "also replay letters already replayed or purged, or older than --retention")
	retention := fs.Duration("retention", inbox.RetentionDefault, "the consumers' idempotency retention: older letters are refused without --force")
	watch := fs.Duration("watch", 0, "after replaying, watch this long for a consumer dead-lettering a replayed event again, and say so (0: do not watch)")
	plan := fs.String("plan", "", "replay exactly the letters a dry run listed: the file of `km0 dlq replay --dry-run --json` (filters given too only count the letters that arrived since)")
	all := addAllFlag(fs, "replay")
	f, env, err := c.start(ctx, fs, o, ff, args, func(f *dlq.Filter) error {
		if *plan != "" {
			return nil
		}
		return all(f)
	})
	if err != nil {
		return err
	}
	defer env.close()
	if *plan != "" {
		ids, err := readPlan(*plan)
		if err != nil {
			return err
		}
		if len(ids) == 0 {
			fmt.Fprintln(c.out, "the dry run listed nothing to replay")
			return nil
		}
		if !f.Empty() {
			sel := f
			sel.States = []dlq.State{dlq.StatePending}
			if n, err := env.svc.Arrived(ctx, sel, ids); err == nil && n > 0 {
				defer fmt.Fprintf(c.out, "%d letter(s) of the selection arrived after the dry run and were not replayed "+
					"(run a new dry run to see them)\n", n)
			}
		}
		f = dlq.Filter{IDs: ids}
	}
	rep, err := env.svc.Replay(ctx, f, dlq.ReplayOptions{DryRun: *dry, Force: *force, Retention: *retention, Actor: cliActor()})
	if err != nil {
		return err
	}
	var takes []dlq.Take
	if !rep.DryRun && *watch > 0 && rep.Done > 0 {
		if takes, err = env.svc.Watch(ctx, *watch, 0, rep); err != nil {
			return err
		}
	}
	if *o.json {
		if err := c.printJSON(rep); err != nil {
			return err
		}
	} else {
		defer func() { _ = c.printTakes(takes, *watch) }()
		verb := "replayed"
		if rep.DryRun {
			verb = "would replay"
		}
		for _, it := range rep.Items {
			if it.Done {
				fmt.Fprintf(c.out, "%s %s -> %s (id_esdeveniment %s)\n", verb, it.ID, it.Topic, orDash(dlq.Safe(it.EventID)))
			} else {
				fmt.Fprintf(c.out, "refused %s: %s\n", it.ID, it.Refused)
			}
		}
		fmt.Fprintf(c.out, "%d selected, %d %s, %d refused\n", rep.Selected, rep.Done, verb, rep.Refused)
	}
	if rep.Refused > 0 {
		return fmt.Errorf("%d letter(s) refused", rep.Refused)
	}
	return notTaken(takes)
}

func (c *dlqCLI) purge(ctx context.Context, args []string) error {
	fs, o := c.flags("purge", "mark dead letters purged (after a confirmation)")
	ff := addFilterFlags(fs)
	yes := fs.Bool("yes", false, "confirm without asking (needed when stdin is not a terminal)")
	del := fs.Bool("delete-records", false, "also delete the records on the DLQ topic, per partition up to the lowest offset still pending")
	f, env, err := c.start(ctx, fs, o, ff, args, addAllFlag(fs, "purge"))
	if err != nil {
		return err
	}
	defer env.close()
	if !*yes {
		sel := f
		if len(sel.IDs) == 0 {
			sel.States = []dlq.State{dlq.StatePending, dlq.StateReplayed}
		}
		// The confirmation acts on the letters counted here, by ID: a letter
		// that dies while the question waits is not purged.
		ids, err := env.svc.Snapshot(ctx, sel)
		if err != nil {
			return err
		}
		n := len(ids)
		if n == 0 {
			fmt.Fprintln(c.out, "nothing to purge")
			return nil
		}
		if !c.tty {
			return fmt.Errorf("refusing to purge %d letter(s) without confirmation: pass --yes (stdin is not a terminal)", n)
		}
		fmt.Fprintf(c.out, "Purge %d dead letter(s)? They are marked purged in the index", n)
		if *del && !env.rabbit {
			fmt.Fprint(c.out, " and their records deleted where no pending letter precedes them")
		}
		fmt.Fprint(c.out, ". [y/N] ")
		answer, rerr := bufio.NewReader(c.in).ReadString('\n')
		if a := strings.ToLower(strings.TrimSpace(answer)); a != "y" && a != "yes" && a != "s" && a != "si" && a != "sí" {
			fmt.Fprintln(c.out)
			if rerr != nil && answer == "" { // e.g. /dev/null, which looks like a terminal
				return errors.New("purge refused: no confirmation on stdin; pass --yes")
			}
			return errors.New("purge cancelled")
		}
		if arrived, err := env.svc.Arrived(ctx, sel, ids); err == nil && arrived > 0 {
			defer fmt.Fprintf(c.out, "%d letter(s) arrived while the question waited and were not purged\n", arrived)
		}
		f = dlq.Filter{IDs: ids}
	}
	rep, err := env.svc.Purge(ctx, f, dlq.PurgeOptions{Confirmed: true, DeleteRecords: *del, Actor: cliActor()})
	if rep != nil && *o.json {
		if jerr := c.printJSON(rep); jerr != nil {
			return jerr
		}
		return err
	}
	if rep != nil {
		for _, it := range rep.Items {
			if !it.Done {
				fmt.Fprintf(c.out, "refused %s: %s\n", it.ID, it.Refused)
			}
		}
		fmt.Fprintf(c.out, "%d letter(s) marked purged in the index, %d refused\n", rep.Done, rep.Refused)
		for _, p := range rep.Deleted {
			fmt.Fprintf(c.out, "deleted the records of %s/%d before offset %d\n", p.Topic, p.Partition, p.Offset)
		}
		if env.rabbit && rep.Done > 0 {
			fmt.Fprintln(c.out, "RabbitMQ: these letters left the broker when they were indexed; the index keeps their bytes.")
		} else if !*del && rep.Done > 0 {
			fmt.Fprintln(c.out, "Kafka cannot delete single records: they stay on the DLQ topic until its retention "+
				"removes them (--delete-records deletes, per partition, up to the lowest pending letter).")
		}
	}
	return err
}

func (c *dlqCLI) index(ctx context.Context, args []string) error {
	fs, o := c.flags("index", "index every new dead letter and alert on it; optionally serve /metrics and the admin API")
	addr := fs.String("http-addr", "", "serve /metrics and the admin API (/dlq/..., bearer token $"+adminTokenEnv+") here, e.g. 127.0.0.1:9464; empty: no HTTP (the Host header is checked)")
	allowed := fs.String("http-allowed-hosts", os.Getenv(hostguard.AllowedHostsEnv), "Host names --http-addr answers besides its listen address: NAME or NAME:PORT,... (default $"+hostguard.AllowedHostsEnv+")")
	interval := fs.Duration("interval", 2*time.Second, "RabbitMQ: time between two syncs of the DLQ queues")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *interval <= 0 {
		return errors.New("--interval must be positive")
	}
	env, err := c.open(ctx, o, prometheus.DefaultRegisterer, false)
	if err != nil {
		return err
	}
	defer env.close()
	var ix *kafkadlq.Indexer
	if !env.rabbit {
		if ix, err = kafkadlq.NewIndexer(kafkadlq.IndexerConfig{Kafka: env.kcfg, Store: env.store, Alerter: env.alerter}); err != nil {
			return err
		}
	}
	if *addr != "" {
		token := os.Getenv(adminTokenEnv)
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.Handler())
		mux.Handle("/dlq/", http.StripPrefix("/dlq", dlq.Handler(env.svc, dlq.HandlerConfig{Token: token, Logger: logger()})))
		ln, err := net.Listen("tcp", *addr)
		if err != nil {
			return err
		}
		// The Host check of the other servers (DNS rebinding); a replay of
		// many letters may take long: the write bound is generous.
		srv := &http.Server{Handler: hostguard.Wrap(mux, ln.Addr(), strings.Split(*allowed, ",")), ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 2 * time.Minute, IdleTimeout: 2 * time.Minute}
		go func() { _ = srv.Serve(ln) }()
		defer srv.Close()
		state := "/dlq/ needs the bearer token of $" + adminTokenEnv
		if token == "" {
			state = "/dlq/ disabled (403): set $" + adminTokenEnv + " to read, replay and purge letters"
		}
		fmt.Fprintf(c.errOut, "km0 dlq index: http://%s/metrics and /dlq/letters; %s\n", ln.Addr(), state)
	}
	if env.rabbit {
		fmt.Fprintf(c.errOut, "km0 dlq index: moving the dead letters of %s into the index every %s\n",
			strings.Join(o.queueNames(), ", "), *interval)
		return syncEvery(ctx, env.svc, *interval, logger())
	}
	fmt.Fprintf(c.errOut, "km0 dlq index: indexing DLQ topics as group %s\n", *o.group)
	return ix.Run(ctx)
}

// syncEvery syncs src now and then every interval until ctx ends (then it
// returns nil). A failed sync is logged and tried again at the next tick.
func syncEvery(ctx context.Context, src dlq.Source, interval time.Duration, log *slog.Logger) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if _, err := src.Sync(ctx); err != nil && ctx.Err() == nil {
			log.Error("km0 dlq index: sync failed; trying again", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// parseInterspersed parses flags that may come after positional arguments.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var rest []string
	for {
		if err := parseFlags(fs, args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, errUsage
		}
		if fs.NArg() == 0 {
			return rest, nil
		}
		rest = append(rest, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

func (c *dlqCLI) printJSON(v any) error {
	enc := json.NewEncoder(c.out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// deadStamp is the dead time of l, or "desconegut" when a time of the letter
// was out of range (dlq.Letter.TimeUnknown).
func deadStamp(l *dlq.Letter) string {
	if l.DeadAt.IsZero() {
		return "desconegut"
	}
	if l.TimeUnknown {
		return stamp(l.DeadAt) + " (temps desconegut)"
	}
	return stamp(l.DeadAt)
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func at(prefix string, t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return prefix + stamp(t)
}

func num(n int64) string {
	if n < 0 {
		return ""
	}
	return fmt.Sprint(n)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func clip(s string, n int) string {
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

// auditLog is `km0 dlq audit`: the audit log, newest first.
func (c *dlqCLI) auditLog(ctx context.Context, args []string) error {
	fs, o := c.flags("audit", "the audit log of replays, purges and edits, newest first")
	id := fs.String("id", "", "only the entries that acted on this letter")
	limit := fs.Int("limit", 100, "at most this many entries")
	if err := parse(fs, args); err != nil {
		return err
	}
	env, err := c.open(ctx, o, nil, false)
	if err != nil {
		return err
	}
	defer env.close()
	log, err := env.svc.AuditLog(ctx, dlq.AuditFilter{Letter: *id, Limit: *limit})
	if err != nil {
		return err
	}
	if *o.json {
		return c.printJSON(log)
	}
	tw := tabwriter.NewWriter(c.out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "EN\tQUI\tACCIO\tCARTES\tREFUSADES\tRESULTAT")
	for _, e := range log {
		letters := strings.Join(e.Letters, " ")
		if len(e.Letters) > 3 {
			letters = strings.Join(e.Letters[:3], " ") + fmt.Sprintf(" … (%d in all)", len(e.Letters))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", stamp(e.At), dlq.Safe(e.Actor), e.Action, orDash(letters), e.Refused, dlq.Safe(e.Result))
	}
	return tw.Flush()
}

// readPlan returns the letters a dry run's JSON report (km0 dlq replay
// --dry-run --json) would replay.
func readPlan(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--plan: %w", err)
	}
	var rep dlq.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		return nil, fmt.Errorf("--plan %s: not the JSON of a dry run: %w", path, err)
	}
	if !rep.DryRun {
		return nil, fmt.Errorf("--plan %s: not a dry run's report (simulacio is false)", path)
	}
	var ids []string
	for _, it := range rep.Items {
		if it.Done {
			ids = append(ids, it.ID)
		}
	}
	return ids, nil
}
