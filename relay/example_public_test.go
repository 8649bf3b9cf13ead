package relay_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// The outbox and the relay as a module that imports km0 uses them, with
// the public API only: a PostgreSQL of yours ($KM0_DATABASE_URL, else the
// local server), a schema of its own for the example, the embedded Kafka
// broker. An order's two events commit in one transaction, one relay cycle
// publishes them in commit order keyed by the order, and a plain Kafka
// reader decodes them.
func Example_publicAPI() {
	ctx := context.Background()
	url := os.Getenv("KM0_DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/postgres"
	}
	schema := fmt.Sprintf("km0_example_%d", time.Now().UnixNano())
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		fmt.Println(err)
		return
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		fmt.Println(err)
		return
	}
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()
	names := migrate.Names{Schema: schema}.WithDefaults()
	if _, err := migrate.Up(ctx, pool, names, migrate.Outbox); err != nil {
		fmt.Println(err)
		return
	}

	broker, err := kafkaembed.Start(kafkaembed.Config{Topics: []string{"botiga.esdeveniments"}})
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

	ob := outbox.New(outbox.Config{Names: names})
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... the business writes, in tx ...
		for _, tipus := range []string{"venda.creada", "venda.pagada"} {
			if err := ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "venda", AggregateID: "V-1",
				Type: tipus, Version: 1, Payload: map[string]any{"id": "V-1"}}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	r, err := relay.New(relay.Config{Pool: pool, Names: names, Publisher: kafka.NewPublisher(cl),
		Topic: "botiga.esdeveniments", Origin: "botiga"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	n, err := r.RunOnce(ctx) // a service calls r.Run(ctx) instead
	fmt.Println("published:", n, err)

	rd, err := kgo.NewClient(kgo.SeedBrokers(broker.Addrs()...), kgo.ConsumeTopics("botiga.esdeveniments"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rd.Close()
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second) // bounds a broken broker only
	defer cancel()
	for seen := 0; seen < 2 && rctx.Err() == nil; {
		rd.PollFetches(rctx).EachRecord(func(rec *kgo.Record) {
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
	// venda.creada key=V-1 origen=botiga
	// venda.pagada key=V-1 origen=botiga
}
