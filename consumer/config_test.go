package consumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/transport/kafka"
)

func TestNewRejectsBadConfigWithClearErrors(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t, pgtest.URL(), 1)
	ok := testConfig{
		Config: consumer.Config{Name: "n", Pool: pool,
			Handle: func(context.Context, pgx.Tx, *consumer.Message) error { return nil }},
		SourceConfig: kafka.SourceConfig{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}},
	}
	if _, err := ok.newConsumer(); err != nil {
		t.Fatalf("valid config refused: %v", err)
	}
	for _, tc := range []struct {
		edit func(*testConfig)
		want string
	}{
		{func(c *testConfig) { c.Brokers = nil }, "no Brokers"},
		{func(c *testConfig) { c.Group = "" }, "no Group"},
		{func(c *testConfig) { c.Topics = []string{"t.retry"} }, "derived"},
		{func(c *testConfig) { c.Topics = []string{"t", "t"} }, "listed twice"},
		{func(c *testConfig) { c.Name = "" }, "no Name"},
		{func(c *testConfig) { c.Name = "inventari\x00x" }, "NUL byte"},
		{func(c *testConfig) { c.Name = strings.Repeat("n", 257) }, "over the limit"},
		{func(c *testConfig) { c.Pool = nil; c.Concurrency = 1 }, "no Pool"},
		{func(c *testConfig) { c.Handle = nil }, "no Handle"},
		{func(c *testConfig) { c.MaxAttempts = -1 }, "MaxAttempts"},
		{func(c *testConfig) { c.Backoff = -1 }, "negative Backoff"},
		{func(c *testConfig) { c.SessionTimeout = -1 }, "negative SessionTimeout"},
		{func(c *testConfig) { c.Mode = 7 }, "unknown Mode"},
		{func(c *testConfig) { c.Order = 9 }, "unknown Order"},
		{func(c *testConfig) { c.Order, c.Behind = consumer.PerKey, 9 }, "unknown Behind"},
		{func(c *testConfig) { c.Order, c.NoInbox = consumer.PerKey, true }, "PerKey needs the inbox"},
		{func(c *testConfig) { c.Order, c.Mode = consumer.PerKey, consumer.AtMostOnce }, "PerKey needs AtLeastOnce"},
		{func(c *testConfig) { c.Topics = []string{"comandes esdeveniments"} }, "only ASCII letters"},
		{func(c *testConfig) { c.Topics = []string{strings.Repeat("t", 244)} }, "1 to 249"}, // 250 with .retry
	} {
		cfg := ok
		tc.edit(&cfg)
		// The source's own problems are kafka.NewSource's error; the
		// consumer's are consumer.New's, wrapping ErrConfig.
		_, serr := kafka.NewSource(cfg.SourceConfig)
		_, err := cfg.newConsumer()
		if err == nil || (serr == nil && !errors.Is(err, consumer.ErrConfig)) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want an error naming %q (ErrConfig unless the source refused), got %v", tc.want, err)
		}
	}
	if _, err := consumer.New(consumer.Config{Name: "n", Pool: pool, Handle: ok.Handle}); !errors.Is(err, consumer.ErrConfig) ||
		!strings.Contains(err.Error(), "no Source") {
		t.Errorf("want an ErrConfig naming the missing Source, got %v", err)
	}
	if src, err := kafka.NewSource(ok.SourceConfig); err != nil || src.Config().SessionTimeout != kafka.SessionTimeoutDefault {
		t.Errorf("default SessionTimeout: %v, want %v", err, kafka.SessionTimeoutDefault)
	}
	noInbox := ok
	noInbox.Name, noInbox.NoInbox = "", true
	if _, err := noInbox.newConsumer(); err != nil {
		t.Fatalf("NoInbox without Name refused: %v", err)
	}
}

// A per-key order consumer on a database without the keyorder tables stops
// at Run with an error that names the migrations, before consuming anything.
func TestPerKeyNeedsTheKeyOrderMigrations(t *testing.T) {
	t.Parallel()
	db := pgtest.NewSchema(t)
	cfg := testConfig{
		Config: consumer.Config{Name: "n", Pool: db.Pool, Names: db.Names(), Order: consumer.PerKey,
			Handle: func(context.Context, pgx.Tx, *consumer.Message) error { return nil }},
		SourceConfig: kafka.SourceConfig{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}},
	}
	c, err := cfg.newConsumer()
	if err != nil {
		t.Fatal(err)
	}
	err = c.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "keyorder migrations") || !strings.Contains(err.Error(), "km0 migrate") {
		t.Fatalf("Run = %v, want an error naming the keyorder migrations and km0 migrate", err)
	}
}
