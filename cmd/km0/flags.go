package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
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
	return nil
}

// databaseURLFlag registers --database-url, defaulting to KM0_DATABASE_URL.
// The environment value is applied after registration, so --help never prints
// it: a URL may hold a password.
func databaseURLFlag(fs *flag.FlagSet) *string {
	return secretString(fs, "database-url", os.Getenv("KM0_DATABASE_URL"), "PostgreSQL URL (default $KM0_DATABASE_URL)")
}

// secretString registers a string flag whose default comes from the
// environment but is assigned after registration, so --help never prints it:
// URLs may hold passwords or tokens.
func secretString(fs *flag.FlagSet, name, def, usage string) *string {
	v := fs.String(name, "", usage)
	*v = def
	return v
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
