package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/transport/kafka"
)

// newFlags returns a flag set whose usage names the command and summary.
func newFlags(name, summary string) *flag.FlagSet {
	fs := flag.NewFlagSet("km0 "+name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "km0 %s: %s\n\nflags:\n", name, summary)
		fs.PrintDefaults()
	}
	return fs
}

// parse parses args, mapping a flag error to errUsage (already printed).
// Then each flag whose value has a check (a credential flag's, see
// secretString and mapFlag) reports what its Set could not: flag quotes the
// value of a failed Set, and a credential is never printed.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "km0: unexpected arguments: %s\n", strings.Join(fs.Args(), " "))
		return errUsage
	}
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if c, ok := f.Value.(checker); ok {
			if err := c.check(); err != nil {
				errs = append(errs, err)
			}
		}
	})
	if len(errs) > 0 {
		fmt.Fprintf(fs.Output(), "km0: %v\n", errors.Join(errs...))
		return errUsage
	}
	if parseOnly {
		return errParsed
	}
	return nil
}

// parseOnly makes parse return errParsed after a successful parse, so the
// command stops before doing anything: the deploy artefacts' test checks
// their command lines against the real flags this way (deploy_test.go).
var parseOnly bool

// errParsed is parse's result while parseOnly is set.
var errParsed = errors.New("km0: flags parsed (parse only)")

// checker is a flag.Value with a check after parsing.
type checker interface{ check() error }

// databaseURLFlag registers --database-url and --database-url-file,
// defaulting to KM0_DATABASE_URL (secretString).
func databaseURLFlag(fs *flag.FlagSet) *string {
	return secretString(fs, "database-url", os.Getenv("KM0_DATABASE_URL"), "PostgreSQL URL (default $KM0_DATABASE_URL)")
}

// secretString registers a flag that may carry a credential (a URL with a
// password, a token) in its three forms: --NAME VALUE (shown by ps: its
// usage says so), --NAME-file PATH (the value is the file's content, one
// line; see readSecretFile), and def, its environment form (e.g.
// os.Getenv("KM0_DATABASE_URL")), which either flag replaces. def is
// assigned after registration and the value has no String, so --help never
// prints it. Giving both --NAME and --NAME-file is a usage error.
func secretString(fs *flag.FlagSet, name, def, usage string) *string {
	v := &secretValue{name: name, val: def}
	fs.Var(v, name, usage+"; on the command line it shows in ps: prefer the environment or --"+name+"-file")
	fs.Func(name+"-file", "read --"+name+" from the file at `PATH` (one line; make it readable by this user only)", v.setFile)
	return &v.val
}

// secretValue is the value of a secretString flag: which of its flags gave
// it, and a conflict found by Set, reported by check after parsing.
type secretValue struct {
	name, val, by string
	both          bool
}

func (v *secretValue) String() string { return "" } // never the value

// Set never fails: flag would print the value in its error.
func (v *secretValue) Set(s string) error {
	v.assign("--"+v.name, s)
	return nil
}

func (v *secretValue) setFile(path string) error {
	s, err := readSecretFile(path)
	if err != nil {
		return err
	}
	v.assign("--"+v.name+"-file", s)
	return nil
}

func (v *secretValue) assign(by, s string) {
	v.both = v.both || (v.by != "" && v.by != by)
	v.val, v.by = s, by
}

func (v *secretValue) check() error {
	if v.both {
		return fmt.Errorf("give --%s or --%s-file, not both", v.name, v.name)
	}
	return nil
}

// secretFileMax bounds what readSecretFile reads.
const secretFileMax = 64 << 10

// readSecretFile returns the content of the file at path, trimmed of
// surrounding white space: the file form of a credential flag. An
// unreadable, empty, multi-line or larger than 64 KiB file is an error that
// names the path, never the content.
func readSecretFile(path string) (string, error) {
	b, err := readSmallFile(path)
	if err != nil {
		return "", err
	}
	s := strings.TrimSpace(string(b))
	switch {
	case s == "":
		return "", fmt.Errorf("%s is empty", path)
	case strings.ContainsAny(s, "\r\n"):
		return "", fmt.Errorf("%s has more than one line (want the value alone)", path)
	}
	return s, nil
}

// readSmallFile reads the file at path, refusing one over secretFileMax.
func readSmallFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err // *fs.PathError: the path and why
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, secretFileMax+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(b) > secretFileMax {
		return nil, fmt.Errorf("%s is larger than %d KiB", path, secretFileMax>>10)
	}
	return b, nil
}

// brokersFlag registers --brokers, defaulting to KM0_KAFKA_BROKERS.
func brokersFlag(fs *flag.FlagSet) *string {
	return fs.String("brokers", os.Getenv("KM0_KAFKA_BROKERS"),
		"Kafka bootstrap brokers, comma separated (default $KM0_KAFKA_BROKERS)")
}

// eventsFlag registers --events, defaulting to KM0_EVENTS.
func eventsFlag(fs *flag.FlagSet) *string {
	return fs.String("events", os.Getenv("KM0_EVENTS"),
		"broker of the domain events: kafka or rabbitmq, then optionally TOPIC=BROKER,... per topic, e.g. kafka,comandes.esdeveniments=rabbitmq (default $KM0_EVENTS, else kafka; give every process the same)")
}

func requireBrokers(s string) ([]string, error) {
	b := kafka.SplitBrokers(s)
	if len(b) == 0 {
		return nil, errors.New("no Kafka brokers: pass --brokers or set KM0_KAFKA_BROKERS")
	}
	return b, nil
}

// openPool opens a pool and checks it answers. The error never contains the
// password of the URL.
func openPool(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, errors.New("no database: pass --database-url or set KM0_DATABASE_URL")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, errors.New("invalid --database-url (not shown: it may hold a password)")
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("database %s: %w", redactURL(cfg), err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("database %s does not answer: %w", redactURL(cfg), err)
	}
	return pool, nil
}

func redactURL(cfg *pgxpool.Config) string {
	c := cfg.ConnConfig
	return fmt.Sprintf("postgres://%s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
}

// logger is the process logger: text to stderr, level from KM0_LOG_LEVEL.
func logger() *slog.Logger {
	lvl := slog.LevelInfo
	if v := os.Getenv("KM0_LOG_LEVEL"); v != "" {
		_ = lvl.UnmarshalText([]byte(v))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
}
