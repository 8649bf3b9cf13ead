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
	pool := pgtest.NewPool(t, pgtest.URL(), 1)
	ok := consumer.Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}, Name: "n", Pool: pool,
		Handle: func(context.Context, pgx.Tx, *consumer.Message) error { return nil }}
	if _, err := consumer.New(ok); err != nil {
		t.Fatalf("valid config refused: %v", err)
	}
	for _, tc := range []struct {
		edit func(*consumer.Config)
		want string
	}{
		{func(c *consumer.Config) { c.Brokers = nil }, "no Brokers"},
		{func(c *consumer.Config) { c.Group = "" }, "no Group"},
		{func(c *consumer.Config) { c.Topics = []string{"t.retry"} }, "derived"},
		{func(c *consumer.Config) { c.Topics = []string{"t", "t"} }, "listed twice"},
		{func(c *consumer.Config) { c.Name = "" }, "no Name"},
		{func(c *consumer.Config) { c.Name = "inventari\x00x" }, "NUL byte"},
		{func(c *consumer.Config) { c.Name = strings.Repeat("n", 257) }, "over the limit"},
		{func(c *consumer.Config) { c.Pool = nil; c.Concurrency = 1 }, "no Pool"},
		{func(c *consumer.Config) { c.Handle = nil }, "no Handle"},
		{func(c *consumer.Config) { c.MaxAttempts = -1 }, "MaxAttempts"},
		{func(c *consumer.Config) { c.Backoff = -1 }, "negative Backoff"},
		{func(c *consumer.Config) { c.SessionTimeout = -1 }, "negative SessionTimeout"},
		{func(c *consumer.Config) { c.Mode = 7 }, "unknown Mode"},
		{func(c *consumer.Config) { c.Topics = []string{"comandes esdeveniments"} }, "only ASCII letters"},
		{func(c *consumer.Config) { c.Topics = []string{strings.Repeat("t", 244)} }, "1 to 249"}, // 250 with .retry
	} {
		cfg := ok
		tc.edit(&cfg)
		_, err := consumer.New(cfg)
		if !errors.Is(err, consumer.ErrConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want an ErrConfig naming %q, got %v", tc.want, err)
		}
	}
	if d := ok.WithDefaults().SessionTimeout; d != kafka.SessionTimeoutDefault {
		t.Errorf("default SessionTimeout %v, want %v", d, kafka.SessionTimeoutDefault)
	}
	noInbox := ok
	noInbox.Name, noInbox.NoInbox = "", true
	if _, err := consumer.New(noInbox); err != nil {
		t.Fatalf("NoInbox without Name refused: %v", err)
	}
}
