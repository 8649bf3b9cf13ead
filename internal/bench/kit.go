package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/kafka"
)

// Kit is what the benchmarks take from the km0 binary: its flag conventions
// (usage lines, the credential flags, the check after parsing) and its way
// of opening a pool and logging, so that `km0 bench` reads like every other
// command. A nil field falls back to the plain flag package and the pgx
// defaults (what the unit tests of this package use).
type Kit struct {
	NewFlags        func(name, summary string) *flag.FlagSet
	Parse           func(fs *flag.FlagSet, args []string) error
	SecretString    func(fs *flag.FlagSet, name, def, usage string) *string
	DatabaseURLFlag func(fs *flag.FlagSet) *string
	BrokersFlag     func(fs *flag.FlagSet) *string
	RequireBrokers  func(s string) ([]string, error)
	OpenPool        func(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error)
	Logger          func() *slog.Logger
	// ErrUsage is returned for a usage error already printed.
	ErrUsage error
}

// kit is the Kit of the running `km0 bench` (Run sets it).
var kit Kit

func newFlags(name, summary string) *flag.FlagSet {
	if kit.NewFlags != nil {
		return kit.NewFlags(name, summary)
	}
	return flag.NewFlagSet("km0 "+name, flag.ContinueOnError)
}

func parse(fs *flag.FlagSet, args []string) error {
	if kit.Parse != nil {
		return kit.Parse(fs, args)
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	return nil
}

func secretString(fs *flag.FlagSet, name, def, usage string) *string {
	if kit.SecretString != nil {
		return kit.SecretString(fs, name, def, usage)
	}
	return fs.String(name, def, usage)
}

func databaseURLFlag(fs *flag.FlagSet) *string {
	if kit.DatabaseURLFlag != nil {
		return kit.DatabaseURLFlag(fs)
	}
	return secretString(fs, "database-url", os.Getenv("KM0_DATABASE_URL"), "PostgreSQL URL (default $KM0_DATABASE_URL)")
}

func brokersFlag(fs *flag.FlagSet) *string {
	if kit.BrokersFlag != nil {
		return kit.BrokersFlag(fs)
	}
	return fs.String("brokers", os.Getenv("KM0_KAFKA_BROKERS"), "Kafka bootstrap brokers, comma separated (default $KM0_KAFKA_BROKERS)")
}

func requireBrokers(s string) ([]string, error) {
	if kit.RequireBrokers != nil {
		return kit.RequireBrokers(s)
	}
	if b := kafka.SplitBrokers(s); len(b) > 0 {
		return b, nil
	}
	return nil, errors.New("no Kafka brokers: pass --brokers or set KM0_KAFKA_BROKERS")
}

func openPool(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error) {
	if kit.OpenPool != nil {
		return kit.OpenPool(ctx, url, maxConns)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, errors.New("invalid --database-url (not shown: it may hold a password)")
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

func logger() *slog.Logger {
	if kit.Logger != nil {
		return kit.Logger()
	}
	return slog.New(slog.NewTextHandler(os.Stderr, nil))
}

// newSigningKey returns a random request/reply signing key of
// requestreply.MinKeyBytes bytes, hex-encoded (so it can travel in the
// environment of the processes a benchmark starts).
func newSigningKey() ([]byte, error) {
	b := make([]byte, requestreply.MinKeyBytes)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("generate a request/reply signing key: %w", err)
	}
	return []byte(hex.EncodeToString(b)), nil
}

// adaptiveOr is n, or "adaptive" for 0 (the relay's adaptive default).
func adaptiveOr(n int) any {
	if n == 0 {
		return "adaptive"
	}
	return n
}

// The relay modes of `km0 relay --mode`.
const (
	modePolling = "polling"
	modeCDC     = "cdc"
)
