package amqp_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/transport/amqp"
)

// Per-key order needs each key in one lane: a plain queue with several
// workers is refused with an error that says what to set; ordered mode and a
// single worker are accepted.
func TestPerKeyNeedsOneLanePerKey(t *testing.T) {
	conn := amqptest.Dial(t)
	pool := pgtest.NewPool(t, pgtest.URL(), 2)
	for _, tc := range []struct {
		cfg  amqp.SourceConfig
		want string // "" accepted
	}{
		{amqp.SourceConfig{Workers: 4}, "use Shards"},
		{amqp.SourceConfig{}, "use Shards"},
		{amqp.SourceConfig{Workers: 1}, ""},
		{amqp.SourceConfig{Shards: 2}, ""},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		tc.cfg.Conn, tc.cfg.Queue = conn, amqptest.Name("t.perkey")
		src, err := amqp.NewSource(ctx, tc.cfg)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		amqptest.DeleteQueuesAtCleanup(t, src.Queues)
		_, err = consumer.New(consumer.Config{Source: src, Name: "n", Pool: pool, Order: consumer.PerKey,
			Handle: func(context.Context, pgx.Tx, *consumer.Message) error { return nil }})
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%+v refused: %v", tc.cfg, err)
		case tc.want != "" && (!errors.Is(err, consumer.ErrConfig) || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%+v: want an ErrConfig naming %q, got %v", tc.cfg, tc.want, err)
		}
	}
}
