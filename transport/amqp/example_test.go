package amqp_test

import (
	"context"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// inventari consumes comanda.creada from RabbitMQ: the effect and its
// idempotency key commit together, then the delivery is acked; insufficient
// stock is permanent (DLQ at once), anything else is retried with backoff.
func ExampleConsumer() {
	ctx := context.Background()
	conn, err := amqp.Dial(ctx, amqp.Config{URL: "amqp://guest:guest@127.0.0.1:5672/"})
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/km0_inventari")
	if err != nil {
		log.Fatal(err)
	}
	src, err := amqp.NewSource(ctx, amqp.SourceConfig{
		Conn: conn, Queue: "inventari.comandes",
		Exchange: "km0.esdeveniments", RoutingKeys: []string{"comandes.esdeveniments"},
	})
	if err != nil {
		log.Fatal(err)
	}
	// The same consumer.Config as on Kafka, but for its Source.
	c, err := consumer.New(consumer.Config{
		Source: src,
		Pool:   pool, Name: "inventari.descompte_estoc", Types: []string{"comanda.creada"},
		Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			tag, err := tx.Exec(ctx, `UPDATE estoc SET unitats = unitats - 1 WHERE producte = 'carbasso' AND unitats >= 1`)
			if err != nil {
				return err // transient by default: retried 1 s, 2 s later
			}
			if tag.RowsAffected() == 0 {
				return outcome.Permanentf("estoc insuficient") // nack(requeue=false): DLQ now
			}
			return nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_ = c.Run(ctx)
}

// Ordered mode: the publisher routes each agregat_id to one of 4 queues,
// each consumed by a single active consumer.
func ExampleShardedPublisher() {
	ctx := context.Background()
	conn, err := amqp.Dial(ctx, amqp.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: "km0.esdeveniments"})
	if err != nil {
		log.Fatal(err)
	}
	sharded := amqp.ShardedPublisher{Next: pub, Shards: 4}
	// Routing key "comandes.esdeveniments.<hash(P-2026-000123) mod 4>".
	err = sharded.Publish(ctx, []*transport.Message{{Topic: "comandes.esdeveniments", Key: []byte("P-2026-000123"),
		Value: []byte(`{"id_esdeveniment":"…","tipus":"comanda.creada","versio":1,"data_ms":0,"origen":"comandes","dades":{}}`)}})
	if err != nil {
		log.Fatal(err)
	}
}
