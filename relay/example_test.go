package relay_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// A relay for the comandes service publishes every committed outbox row to
// comandes.esdeveniments, keyed by agregat_id, and marks it published.
// Here it runs one cycle against the embedded Kafka broker; a service calls
// Run instead, in as many instances as it likes (they share the 64 shards
// and keep each order's events in commit order).
func Example() {
	ctx := context.Background()
	db, drop, err := pgtest.Temp(ctx) // a fresh schema on the test PostgreSQL
	if err != nil {
		fmt.Println(err)
		return
	}
	defer drop()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Outbox); err != nil {
		fmt.Println(err)
		return
	}
	broker, err := kafkaembed.Start(kafkaembed.Config{Topics: []string{"comandes.esdeveniments"}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer broker.Close()
	cl, err := kafka.NewClient(broker.Addrs())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()

	ob := outbox.New(outbox.Config{Names: db.Names()})
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for _, tipus := range []string{"comanda.creada", "comanda.pagada"} {
			if err := ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: "P-2026-000123",
				Type: tipus, Version: 1, Payload: map[string]any{"id": "P-2026-000123"}}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	r, err := relay.New(relay.Config{
		Pool:      db.Pool,
		Names:     db.Names(),
		Publisher: kafka.NewPublisher(cl),
		Topic:     "comandes.esdeveniments",
		Origin:    "comandes",
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	n, err := r.RunOnce(ctx)
	fmt.Println("published:", n, err)

	var pending int
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE publicat_en IS NULL`).Scan(&pending)
	fmt.Println("still pending:", pending)

	rd, err := kgo.NewClient(kgo.SeedBrokers(broker.Addrs()...), kgo.ConsumeTopics("comandes.esdeveniments"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rd.Close()
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for seen := 0; seen < 2 && rctx.Err() == nil; {
		fs := rd.PollFetches(rctx)
		fs.EachRecord(func(rec *kgo.Record) {
			seen++
			env, err := envelope.Decode(rec.Value)
			if err != nil {
				fmt.Println(err)
				return
			}
			fmt.Printf("%s key=%s origen=%s\n", env.Type, rec.Key, env.Origin)
		})
	}
	// Output:
	// published: 2 <nil>
	// still pending: 0
	// comanda.creada key=P-2026-000123 origen=comandes
	// comanda.pagada key=P-2026-000123 origen=comandes
}
