package relay_test

import (
	"context"
	"log"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport/kafka"
)

// A relay for the comandes service: it publishes every committed row of
// public.outbox to comandes.esdeveniments until interrupted. Run as many
// instances as you like; they share the 64 shards and keep each order's
// events in commit order.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	cl, err := kafka.NewClient(kafka.SplitBrokers(os.Getenv("KM0_KAFKA_BROKERS")))
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	r, err := relay.New(relay.Config{
		Pool:      pool,
		Names:     migrate.Names{Schema: "public"},
		Publisher: kafka.NewPublisher(cl),
		Topic:     "comandes.esdeveniments",
		Origin:    "comandes",
		Logger:    slog.Default(),
		Metrics:   prometheus.DefaultRegisterer,
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := r.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
