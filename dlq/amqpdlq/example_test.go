package amqpdlq_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/amqpdlq"
	"github.com/km0/km0/transport/amqp"
)

// The DLQ of a RabbitMQ work queue: the index takes custody of its letters
// (Sync acks them off the broker only after they are indexed), then list by
// motiu and replay the fixed ones, with the same operations as on Kafka.
// Compiled, not run (no Output): it wires a service against its own
// database and RabbitMQ, so deadcode -test reports it unreachable.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	conn, err := amqp.Dial(ctx, amqp.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	backend, err := amqpdlq.New(amqpdlq.Config{Conn: conn, Queues: []string{"repartiment.assignacio"}})
	if err != nil {
		log.Fatal(err)
	}
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: dlq.NewStore(pool, "public"), Backend: backend})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := svc.Sync(ctx); err != nil {
		log.Fatal(err)
	}
	l, err := svc.List(ctx, dlq.Filter{Reason: "permanent"})
	if err != nil {
		log.Fatal(err)
	}
	for _, g := range l.Groups {
		fmt.Println(g)
	}
	rep, err := svc.Replay(ctx, dlq.Filter{Reason: "permanent"}, dlq.ReplayOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d replayed\n", rep.Done)
}
