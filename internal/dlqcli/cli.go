// Package dlqcli is `km0 dlq`: the listing, rendering and replay, purge and
// sequence flows of dead letters over package dlq, and the shared flags and
// opening of the index km0 console uses too. cmd/km0 only registers it.
package dlqcli

import (
	"bufio"
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

	"github.com/km0/km0/internal/cli"
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

// AdminTokenEnv holds the admin token of the DLQ admin API and the console.
const AdminTokenEnv = "KM0_DLQ_ADMIN_TOKEN"

// Main is the `km0 dlq` command over the process's streams.
func Main(ctx context.Context, args []string) error {
	fi, err := os.Stdin.Stat()
	tty := err == nil && fi.Mode()&os.ModeCharDevice != 0
	return (&CLI{Out: os.Stdout, ErrOut: os.Stderr, In: os.Stdin, TTY: tty, Now: time.Now}).Run(ctx, args)
}

// CLI holds the process's streams so tests can run the commands.
type CLI struct {
	Out, ErrOut io.Writer
	In          io.Reader
	TTY         bool // stdin is a terminal: purge may ask for confirmation
	Now         func() time.Time
}

// Run runs `km0 dlq` with args (the words after dlq).
func (c *CLI) Run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		fmt.Fprint(c.ErrOut, dlqUsage)
		return cli.ErrUsage
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
		fmt.Fprint(c.Out, dlqUsage)
		return nil
	}
	fmt.Fprintf(c.ErrOut, "km0 dlq: unknown command %q\n\n%s", args[0], dlqUsage)
	return cli.ErrUsage
}

// Opts are the flags every dlq command shares.
type Opts struct {
	Brokers, Schema, Group, AMQPURL *string
	AMQPTLS                         *cli.AMQPTLSFlags
	JSON                            *bool // nil but for the dlq commands
	dbURL, topics, webhook          *string
	queues                          *cli.ListFlag
	syncTimeout                     *time.Duration
	kafka                           *cli.KafkaSecurity
	fs                              *flag.FlagSet
}

// rabbit reports whether the RabbitMQ backend is selected: --queue given, or
// --amqp-url or --amqp-url-file set on the command line ($KM0_AMQP_URL alone
// does not select it).
func (o *Opts) rabbit() bool {
	set := len(*o.queues) > 0
	o.fs.Visit(func(f *flag.Flag) { set = set || f.Name == "amqp-url" || f.Name == "amqp-url-file" })
	return set
}

// QueueNames splits the --queue values on commas.
func (o *Opts) QueueNames() []string {
	var out []string
	for _, v := range *o.queues {
		out = append(out, kafka.SplitBrokers(v)...)
	}
	return out
}

func (c *CLI) flags(name, summary string) (*flag.FlagSet, *Opts) {
	fs, o := c.FlagsFor("dlq "+name, summary)
	o.JSON = fs.Bool("json", false, "print JSON for scripts")
	return fs, o
}

// FlagsFor registers the flags every dlq command shares (but --json) on a
// flag set named command; km0 console uses them too.
func (c *CLI) FlagsFor(command, summary string) (*flag.FlagSet, *Opts) {
	fs := cli.NewFlags(command, summary)
	fs.SetOutput(c.ErrOut)
	o := &Opts{
		dbURL:   cli.DatabaseURLFlag(fs),
		Brokers: cli.BrokersFlag(fs),
		kafka:   cli.KafkaSecurityFlags(fs),
		Schema:  fs.String("schema", migrate.SchemaDefault, "PostgreSQL schema of the index table cartes_mortes"),
		topics: fs.String("topics", "", "DLQ topics, comma separated (default: every topic matching "+
			kafkadlq.TopicPatternDefault+")"),
		Group:       fs.String("group", kafkadlq.GroupDefault, "consumer group whose offsets mark what is indexed"),
		webhook:     cli.SecretString(fs, "webhook", os.Getenv("KM0_DLQ_WEBHOOK"), "URL that gets a JSON notice per new dead letter (default $KM0_DLQ_WEBHOOK)"),
		syncTimeout: fs.Duration("sync-timeout", dlq.SyncTimeoutDefault, "how long reading the DLQ topics may take"),
		queues:      &cli.ListFlag{},
		fs:          fs,
	}
	o.AMQPURL = cli.SecretString(fs, "amqp-url", os.Getenv("KM0_AMQP_URL"), "RabbitMQ URL: operate the DLQ queues of --queue (default $KM0_AMQP_URL, else the local guest broker)")
	o.AMQPTLS = cli.AddAMQPTLSFlags(fs)
	fs.Var(o.queues, "queue", "RabbitMQ work queue whose <queue>.dlq to operate (repeatable or comma separated); selects RabbitMQ")
	return fs, o
}

// Env is an open Source and how to close it. Svc is a dlq.Service over
// the Kafka backend or, with --queue/--amqp-url, the RabbitMQ one; every
// command and the admin API use it unchanged.
type Env struct {
	Svc       dlq.Source
	Store     *dlq.Store
	Pool      *pgxpool.Pool // the index's database (also the consumers' keyorder tables)
	Rabbit    bool
	Kafka     kafkadlq.Config
	KafkaOpts []kgo.Opt // the Kafka security of --brokers, for every Kafka client
	Alerter   *dlq.Alerter
	Close     func()
	backend   *kafkadlq.Backend // nil with RabbitMQ
}

// Open connects, applies the dlq migrations, and syncs the index.
func (c *CLI) Open(ctx context.Context, o *Opts, reg prometheus.Registerer, sync bool) (*Env, error) {
	var brokers []string
	var err error
	if !o.rabbit() {
		brokers, err = cli.RequireBrokers(*o.Brokers)
	} else if len(o.QueueNames()) == 0 {
		err = errors.New("--amqp-url needs --queue: the work queues whose <queue>.dlq to operate")
	}
	if err != nil {
		return nil, err
	}
	pool, err := cli.OpenPool(ctx, *o.dbURL, 4)
	if err != nil {
		return nil, err
	}
	env := &Env{Close: pool.Close, Pool: pool}
	fail := func(err error) (*Env, error) { env.Close(); return nil, err }
	if _, err := migrate.Up(ctx, pool, migrate.Names{Schema: *o.Schema}, dlq.Migrations); err != nil {
		return fail(err)
	}
	log := cli.Logger()
	if bs := kafka.SplitBrokers(*o.Brokers); len(bs) > 0 {
		if env.KafkaOpts, err = o.kafka.Opts(ctx, bs, log); err != nil {
			return fail(err)
		}
	}
	var backend dlq.Backend
	if o.rabbit() {
		env.Rabbit = true
		tlsCfg, err := o.AMQPTLS.Config()
		if err != nil {
			return fail(err)
		}
		conn, err := amqp.Dial(ctx, amqp.Config{URL: *o.AMQPURL, Name: "km0 dlq", Logger: log, TLS: tlsCfg})
		if err != nil {
			return fail(err) // names the URL without its password
		}
		ab, err := amqpdlq.New(amqpdlq.Config{Conn: conn, Queues: o.QueueNames(), SyncTimeout: *o.syncTimeout, Logger: log})
		if err != nil {
			_ = conn.Close()
			return fail(err)
		}
		closePool := env.Close
		env.Close = func() { _ = ab.Close(); _ = conn.Close(); closePool() }
		backend = ab
	} else {
		env.Kafka = kafkadlq.Config{Brokers: brokers, Topics: kafka.SplitBrokers(*o.topics), Group: *o.Group,
			SyncTimeout: *o.syncTimeout, Logger: log, ClientOpts: env.KafkaOpts}
		if env.backend, err = kafkadlq.New(env.Kafka); err != nil {
			return fail(err)
		}
		closePool := env.Close
		env.Close = func() { env.backend.Close(); closePool() }
		backend = env.backend
	}
	if reg == nil {
		reg = prometheus.NewRegistry() // a one-shot command exports no metrics
	}
	if env.Alerter, err = dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, Logger: log, WebhookURL: *o.webhook}); err != nil {
		return fail(err)
	}
	closeBroker := env.Close
	env.Close = func() {
		// Give queued webhook notices a bounded chance to go out.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer cancel()
		_ = env.Alerter.Close(cctx)
		closeBroker()
	}
	env.Store = dlq.NewStore(pool, *o.Schema)
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: env.Store, Backend: backend, Alerter: env.Alerter, Logger: log})
	if err != nil {
		return fail(err)
	}
	env.Svc = svc
	if sync {
		res, err := env.Svc.Sync(ctx)
		if err != nil {
			return fail(fmt.Errorf("sync the index: %w", err))
		}
		if len(res.New) > 0 {
			fmt.Fprintf(c.ErrOut, "km0 dlq: %d new dead letter(s) indexed\n", len(res.New))
		}
	}
	return env, nil
}

// filterFlags registers the selection flags of replay and purge.
type filterFlags struct {
	topic, motiu, since, until, group *string
	ids                               *cli.ListFlag
}

func addFilterFlags(fs *flag.FlagSet) *filterFlags {
	f := &filterFlags{
		topic: fs.String("topic", "", "only this topic: a DLQ topic (x.dlq) or an original topic (x)"),
		motiu: fs.String("reason", "", `only letters whose motiu (reason) starts with this, e.g. "permanent: esquema"`),
		since: fs.String("since", "", "only letters dead at or after this: RFC 3339, YYYY-MM-DD, or an age (36h, 7d)"),
		until: fs.String("until", "", "only letters dead before this (same forms as --since)"),
		group: fs.String("consumer", "", "only letters of this consumer (grup_consumidor: the Kafka group or RabbitMQ work queue)"),
		ids:   &cli.ListFlag{},
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
	all := fs.Bool("all", false, "select every letter (required to "+verb+" without --id, --topic, --reason, --consumer, --since or --until)")
	return func(f *dlq.Filter) error {
		switch {
		case f.Empty() && !*all:
			return fmt.Errorf("refusing to %s every letter: no --id, --topic, --reason, --consumer, --since or --until given; pass --all to select every letter", verb)
		case !f.Empty() && *all:
			return fmt.Errorf("--all selects every letter: give it without --id, --topic, --reason, --consumer, --since or --until")
		}
		return nil
	}
}

// start parses args, builds the selection, then connects and syncs. check,
// if not nil, validates more flags before anything is opened.
func (c *CLI) start(ctx context.Context, fs *flag.FlagSet, o *Opts, ff *filterFlags, args []string,
	check func(*dlq.Filter) error) (dlq.Filter, *Env, error) {
	if err := cli.Parse(fs, args); err != nil {
		return dlq.Filter{}, nil, err
	}
	f, err := ff.filter(c.Now())
	if err == nil && check != nil {
		err = check(&f)
	}
	if err != nil {
		return f, nil, err
	}
	env, err := c.Open(ctx, o, nil, true)
	return f, env, err
}

func (c *CLI) ls(ctx context.Context, args []string) error {
	fs, o := c.flags("ls", "list dead letters grouped by topic and motiu (counts), then the rows")
	ff := addFilterFlags(fs)
	state := fs.String("state", "pending", "pending, replayed, purged or all (the index's pendent, reproduida, purgada, totes are accepted too)")
	limit := fs.Int("limit", 200, "rows to print at most (0 = all); the counts always cover every letter")
	f, env, err := c.start(ctx, fs, o, ff, args, func(f *dlq.Filter) (err error) {
		f.Limit, f.Fold = *limit, true
		f.States, err = dlq.ParseState(*state)
		return err
	})
	if err != nil {
		return err
	}
	defer env.Close()
	ls, err := env.Svc.List(ctx, f)
	if err != nil {
		return err
	}
	if *o.JSON {
		return c.printJSON(dlq.ListingView(ls))
	}
	total := 0
	for _, g := range ls.Groups {
		total += g.Count
	}
	fmt.Fprintf(c.Out, "%d dead letter(s) (state %s)\n", total, statesEnglish(f.States))
	if ls.Refused > 0 {
		fmt.Fprintf(c.Out, "%d letter(s) refused by the index, set aside in table %s (the error log names each)\n",
			ls.Refused, dlq.RefusedTable)
	}
	if total == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(c.Out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nTOPIC\tCONSUMER_GROUP\tREASON\tLETTERS\tOLDEST\tNEWEST")
	for _, g := range ls.Groups {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", g.Topic, dlq.Safe(g.Consumer), dlq.Safe(g.Class), g.Count, stamp(g.Oldest), stamp(g.Newest))
	}
	fmt.Fprintln(tw, "\nID\tDEAD_AT\tATTEMPTS\tSTATE\tTIPUS\tID_ESDEVENIMENT\tREASON")
	folded := 0
	for _, l := range ls.Letters {
		id := l.ID
		if l.Copies > 1 {
			id += fmt.Sprintf(" (+%d)", l.Copies-1)
			folded += l.Copies - 1
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\n", id, deadStamp(l), l.Attempts, l.State.English(),
			orDash(dlq.Safe(l.Type)), orDash(dlq.Safe(l.EventID)), clip(dlq.Safe(l.Reason), 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if folded > 0 {
		fmt.Fprintf(c.Out, "%d duplicate letter(s) folded: the same event dead in the same consumer more than once "+
			"(after a crash both retry copies of a message can reach it); replaying one is enough\n", folded)
	}
	if len(ls.Letters)+folded < total {
		fmt.Fprintf(c.Out, "(%d of %d rows shown; --limit 0 shows all)\n", len(ls.Letters), total)
	}
	return nil
}

func (c *CLI) show(ctx context.Context, args []string) error {
	fs, o := c.flags("show", "show one dead letter: fields, headers and the envelope")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: km0 dlq show [flags] ID   (ID as printed by km0 dlq ls: <dlq topic>/<partition>/<offset>)\n\nflags:\n")
		fs.PrintDefaults()
	}
	rest, err := cli.ParseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(rest) != 1 {
		fmt.Fprintln(c.ErrOut, "km0 dlq show: want exactly one letter ID")
		fs.Usage()
		return cli.ErrUsage
	}
	env, err := c.Open(ctx, o, nil, true)
	if err != nil {
		return err
	}
	defer env.Close()
	l, err := env.Svc.Get(ctx, rest[0])
	if err != nil {
		return err
	}
	if *o.JSON {
		return c.printJSON(dlq.View(l, true))
	}
	tw := tabwriter.NewWriter(c.Out, 2, 4, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, v) }
	row("id", l.ID)
	row("state", fmt.Sprintf("%s (replays %d%s%s)", l.State.English(), l.Replays, at(", last ", l.ReplayedAt), at(", purged ", l.PurgedAt)))
	row("original topic", fmt.Sprintf("%s (partition %s, offset %s)", l.OriginalTopic, orDash(num(int64(l.OriginalPartition))), orDash(num(l.OriginalOffset))))
	row("motiu (reason)", dlq.Safe(l.Reason))
	row("attempts", fmt.Sprint(l.Attempts))
	row("tipus", orDash(dlq.Safe(l.Type)))
	row("id_esdeveniment", orDash(dlq.Safe(l.EventID)))
	row("key", fmt.Sprintf("%q", l.Key))
	row("first failure", orDash(stamp(l.FirstFailure)))
	row("event time", orDash(stamp(l.EventTime)))
	row("dead at", deadStamp(l))
	row("consumer group", orDash(dlq.Safe(l.ConsumerGroup)))
	_ = tw.Flush()
	if err := c.printHistory(l); err != nil {
		return err
	}
	fmt.Fprintln(c.Out, "\nheaders:")
	for _, h := range l.Headers {
		fmt.Fprintf(c.Out, "  %s: %s\n", dlq.Safe(h.Key), dlq.Safe(h.Value))
	}
	text, isJSON := dlq.PrettyValue(l.Value, 0)
	_, envErr := l.Envelope()
	switch {
	case envErr == nil:
		fmt.Fprintf(c.Out, "\nenvelope:\n%s\n", text)
	case isJSON:
		fmt.Fprintf(c.Out, "\nvalue (JSON, but not a valid envelope: %s):\n%s\n", dlq.Safe(envErr.Error()), text)
	default:
		fmt.Fprintf(c.Out, "\nvalue (%d bytes, not JSON: %s), escaped:\n%s\n", len(l.Value), dlq.Safe(envErr.Error()), text)
	}
	return nil
}

func (c *CLI) replay(ctx context.Context, args []string) error {
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
	defer env.Close()
	if *plan != "" {
		ids, err := readPlan(*plan)
		if err != nil {
			return err
		}
		if len(ids) == 0 {
			fmt.Fprintln(c.Out, "the dry run listed nothing to replay")
			return nil
		}
		if !f.Empty() {
			sel := f
			sel.States = []dlq.State{dlq.StatePending}
			if n, err := env.Svc.Arrived(ctx, sel, ids); err == nil && n > 0 {
				defer fmt.Fprintf(c.Out, "%d letter(s) of the selection arrived after the dry run and were not replayed "+
					"(run a new dry run to see them)\n", n)
			}
		}
		f = dlq.Filter{IDs: ids}
	}
	rep, err := env.Svc.Replay(ctx, f, dlq.ReplayOptions{DryRun: *dry, Force: *force, Retention: *retention, Actor: cliActor()})
	if err != nil {
		return err
	}
	var takes []dlq.Take
	if !rep.DryRun && *watch > 0 && rep.Done > 0 {
		if takes, err = env.Svc.Watch(ctx, *watch, 0, rep); err != nil {
			return err
		}
	}
	if *o.JSON {
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
				fmt.Fprintf(c.Out, "%s %s -> %s (id_esdeveniment %s)\n", verb, it.ID, it.Topic, orDash(dlq.Safe(it.EventID)))
			} else {
				fmt.Fprintf(c.Out, "refused %s: %s\n", it.ID, it.Refused)
			}
		}
		fmt.Fprintf(c.Out, "%d selected, %d %s, %d refused\n", rep.Selected, rep.Done, verb, rep.Refused)
	}
	if rep.Refused > 0 {
		return fmt.Errorf("%d letter(s) refused", rep.Refused)
	}
	return notTaken(takes)
}

func (c *CLI) purge(ctx context.Context, args []string) error {
	fs, o := c.flags("purge", "mark dead letters purged (after a confirmation)")
	ff := addFilterFlags(fs)
	yes := fs.Bool("yes", false, "confirm without asking (needed when stdin is not a terminal)")
	del := fs.Bool("delete-records", false, "also delete the records on the DLQ topic, per partition up to the lowest offset still pending")
	f, env, err := c.start(ctx, fs, o, ff, args, addAllFlag(fs, "purge"))
	if err != nil {
		return err
	}
	defer env.Close()
	if !*yes {
		sel := f
		if len(sel.IDs) == 0 {
			sel.States = []dlq.State{dlq.StatePending, dlq.StateReplayed}
		}
		// The confirmation acts on the letters counted here, by ID: a letter
		// that dies while the question waits is not purged.
		ids, err := env.Svc.Snapshot(ctx, sel)
		if err != nil {
			return err
		}
		n := len(ids)
		if n == 0 {
			fmt.Fprintln(c.Out, "nothing to purge")
			return nil
		}
		if !c.TTY {
			return fmt.Errorf("refusing to purge %d letter(s) without confirmation: pass --yes (stdin is not a terminal)", n)
		}
		fmt.Fprintf(c.Out, "Purge %d dead letter(s)? They are marked purged in the index", n)
		if *del && !env.Rabbit {
			fmt.Fprint(c.Out, " and their records deleted where no pending letter precedes them")
		}
		fmt.Fprint(c.Out, ". [y/N] ")
		answer, rerr := bufio.NewReader(c.In).ReadString('\n')
		if a := strings.ToLower(strings.TrimSpace(answer)); a != "y" && a != "yes" {
			fmt.Fprintln(c.Out)
			if rerr != nil && answer == "" { // e.g. /dev/null, which looks like a terminal
				return errors.New("purge refused: no confirmation on stdin; pass --yes")
			}
			return errors.New("purge cancelled")
		}
		if arrived, err := env.Svc.Arrived(ctx, sel, ids); err == nil && arrived > 0 {
			defer fmt.Fprintf(c.Out, "%d letter(s) arrived while the question waited and were not purged\n", arrived)
		}
		f = dlq.Filter{IDs: ids}
	}
	rep, err := env.Svc.Purge(ctx, f, dlq.PurgeOptions{Confirmed: true, DeleteRecords: *del, Actor: cliActor()})
	if rep != nil && *o.JSON {
		if jerr := c.printJSON(rep); jerr != nil {
			return jerr
		}
		return err
	}
	if rep != nil {
		for _, it := range rep.Items {
			if !it.Done {
				fmt.Fprintf(c.Out, "refused %s: %s\n", it.ID, it.Refused)
			}
		}
		fmt.Fprintf(c.Out, "%d letter(s) marked purged in the index, %d refused\n", rep.Done, rep.Refused)
		for _, p := range rep.Deleted {
			fmt.Fprintf(c.Out, "deleted the records of %s/%d before offset %d\n", p.Topic, p.Partition, p.Offset)
		}
		if env.Rabbit && rep.Done > 0 {
			fmt.Fprintln(c.Out, "RabbitMQ: these letters left the broker when they were indexed; the index keeps their bytes.")
		} else if !*del && rep.Done > 0 {
			fmt.Fprintln(c.Out, "Kafka cannot delete single records: they stay on the DLQ topic until its retention "+
				"removes them (--delete-records deletes, per partition, up to the lowest pending letter).")
		}
	}
	return err
}

func (c *CLI) index(ctx context.Context, args []string) error {
	fs, o := c.flags("index", "index every new dead letter and alert on it; optionally serve /metrics and the admin API")
	addr := fs.String("http-addr", "", "serve /metrics and the admin API (/dlq/..., bearer token $"+AdminTokenEnv+") here, e.g. 127.0.0.1:9464; empty: no HTTP (the Host header is checked)")
	allowed := fs.String("http-allowed-hosts", os.Getenv(hostguard.AllowedHostsEnv), "Host names --http-addr answers besides its listen address: NAME or NAME:PORT,... (default $"+hostguard.AllowedHostsEnv+")")
	interval := fs.Duration("interval", 2*time.Second, "RabbitMQ: time between two syncs of the DLQ queues")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *interval <= 0 {
		return errors.New("--interval must be positive")
	}
	env, err := c.Open(ctx, o, prometheus.DefaultRegisterer, false)
	if err != nil {
		return err
	}
	defer env.Close()
	var ix *kafkadlq.Indexer
	if !env.Rabbit {
		if ix, err = kafkadlq.NewIndexer(kafkadlq.IndexerConfig{Kafka: env.Kafka, Store: env.Store, Alerter: env.Alerter}); err != nil {
			return err
		}
	}
	if *addr != "" {
		token := os.Getenv(AdminTokenEnv)
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.Handler())
		mux.Handle("/dlq/", http.StripPrefix("/dlq", dlq.Handler(env.Svc, dlq.HandlerConfig{Token: token, Logger: cli.Logger()})))
		ln, err := net.Listen("tcp", *addr)
		if err != nil {
			return err
		}
		// The Host check of the other servers (DNS rebinding); a replay of
		// many letters may take long: the write bound is generous.
		srv := &http.Server{Handler: hostguard.Wrap(mux, ln.Addr(), strings.Split(*allowed, ",")), ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 2 * time.Minute, IdleTimeout: 2 * time.Minute}
		go func() { _ = srv.Serve(ln) }()
		defer srv.Close()
		state := "/dlq/ needs the bearer token of $" + AdminTokenEnv
		if token == "" {
			state = "/dlq/ disabled (403): set $" + AdminTokenEnv + " to read, replay and purge letters"
		}
		fmt.Fprintf(c.ErrOut, "km0 dlq index: http://%s/metrics and /dlq/letters; %s\n", ln.Addr(), state)
	}
	if env.Rabbit {
		fmt.Fprintf(c.ErrOut, "km0 dlq index: moving the dead letters of %s into the index every %s\n",
			strings.Join(o.QueueNames(), ", "), *interval)
		return SyncEvery(ctx, env.Svc, *interval, cli.Logger())
	}
	fmt.Fprintf(c.ErrOut, "km0 dlq index: indexing DLQ topics as group %s\n", *o.Group)
	return ix.Run(ctx)
}

// SyncEvery syncs src now and then every interval until ctx ends (then it
// returns nil). A failed sync is logged and tried again at the next tick.
func SyncEvery(ctx context.Context, src dlq.Source, interval time.Duration, log *slog.Logger) error {
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

func (c *CLI) printJSON(v any) error {
	enc := json.NewEncoder(c.Out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// deadStamp is the dead time of l, or "unknown"; a time of the letter that
// was out of range is said (dlq.Letter.TimeUnknown).
func deadStamp(l *dlq.Letter) string {
	if l.DeadAt.IsZero() {
		return "unknown"
	}
	if l.TimeUnknown {
		return stamp(l.DeadAt) + " (time unknown: out of range)"
	}
	return stamp(l.DeadAt)
}

// printHistory prints the attempt history of l (dlq.Letter.History) as a
// table, oldest first; nothing when the letter carries none.
func (c *CLI) printHistory(l *dlq.Letter) error {
	h := l.History()
	if len(h) == 0 {
		return nil
	}
	fmt.Fprintf(c.Out, "\nattempt history (last %d, oldest first):\n", len(h))
	tw := tabwriter.NewWriter(c.Out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ATTEMPT\tFAILED_AT\tERROR")
	for _, a := range h {
		fmt.Fprintf(tw, "%d\t%s\t%s\n", a.N, orDash(stamp(a.At)), orDash(dlq.Safe(a.Error)))
	}
	return tw.Flush()
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

// statesEnglish names the states a listing covers as people read them:
// "all" for every state (none given), else each in English, comma separated.
func statesEnglish(states []dlq.State) string {
	if len(states) == 0 {
		return "all"
	}
	words := make([]string, len(states))
	for i, st := range states {
		words[i] = st.English()
	}
	return strings.Join(words, ", ")
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
func (c *CLI) auditLog(ctx context.Context, args []string) error {
	fs, o := c.flags("audit", "the audit log of replays, purges and edits, newest first")
	id := fs.String("id", "", "only the entries that acted on this letter")
	limit := fs.Int("limit", 100, "at most this many entries")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	env, err := c.Open(ctx, o, nil, false)
	if err != nil {
		return err
	}
	defer env.Close()
	log, err := env.Svc.AuditLog(ctx, dlq.AuditFilter{Letter: *id, Limit: *limit})
	if err != nil {
		return err
	}
	if *o.JSON {
		return c.printJSON(log)
	}
	tw := tabwriter.NewWriter(c.Out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "AT\tWHO\tACTION\tLETTERS\tREFUSED\tRESULT")
	for _, e := range log {
		letters := strings.Join(e.Letters, " ")
		if len(e.Letters) > 3 {
			letters = strings.Join(e.Letters[:3], " ") + fmt.Sprintf(" … (%d in all)", len(e.Letters))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", stamp(e.At), dlq.Safe(e.Actor), dlq.Safe(dlq.ActionEnglish(e.Action)), orDash(letters), e.Refused,
			dlq.Safe(dlq.ResultEnglish(e.Result)))
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
