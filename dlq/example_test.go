package dlq_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/migrate"
)

// Wiring the DLQ tools of a service: the index table, the indexer that
// alerts on every new dead letter, the admin API, and a fix-and-replay of
// the letters dead-lettered for a schema problem.
// Compiled, not run (no Output): it wires a service against its own
// database and broker, so deadcode -test reports it unreachable.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	if _, err := migrate.Up(ctx, pool, migrate.Names{}, dlq.Migrations); err != nil {
		log.Fatal(err)
	}
	store := dlq.NewStore(pool, "public")
	kcfg := kafkadlq.Config{Brokers: []string{"127.0.0.1:9092"}} // every *.dlq topic
	alerter, err := dlq.NewAlerter(dlq.AlerterConfig{WebhookURL: os.Getenv("KM0_DLQ_WEBHOOK")})
	if err != nil {
		log.Fatal(err)
	}
	ix, err := kafkadlq.NewIndexer(kafkadlq.IndexerConfig{Kafka: kcfg, Store: store, Alerter: alerter})
	if err != nil {
		log.Fatal(err)
	}
	go ix.Run(ctx)

	backend, err := kafkadlq.New(kcfg)
	if err != nil {
		log.Fatal(err)
	}
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: store, Backend: backend, Alerter: alerter})
	if err != nil {
		log.Fatal(err)
	}
	http.Handle("/dlq/", http.StripPrefix("/dlq", dlq.Handler(svc, dlq.HandlerConfig{Token: os.Getenv("KM0_DLQ_ADMIN_TOKEN")})))

	// After deploying a handler that accepts both versions:
	rep, err := svc.Replay(ctx, dlq.Filter{Reason: "permanent: esquema"}, dlq.ReplayOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d replayed, %d refused\n", rep.Done, rep.Refused)
}
