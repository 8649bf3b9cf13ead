package cdc_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// The CDC relay reads the outbox's inserts from the write-ahead log
// (logical replication, pgoutput) instead of polling the table: events go
// out in commit order, a moment after their commit, and each row is marked
// published once the broker has confirmed it. The server needs
// wal_level = logical (this package's tests run a private cluster with it).
// A service runs Run until it stops; here the example stops it once both
// events are on the topic.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	db, drop, err := pgtest.Temp(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer drop()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Outbox); err != nil {
		fmt.Println(err)
		return
	}
	const topic = "comandes.esdeveniments"
	broker, err := kafkaembed.Start(kafkaembed.Config{Topics: []string{topic}})
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

	r, err := cdc.New(cdc.Config{Config: relay.Config{Pool: db.Pool, Names: db.Names(), Publisher: kafka.NewPublisher(cl),
		Topic: topic, Origin: "comandes", Logger: slog.New(slog.DiscardHandler)}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	defer func() { // stop the relay, then drop its slot and publication
		stop()
		<-done
		var database string
		_ = db.Pool.QueryRow(ctx, "SELECT current_database()").Scan(&database)
		_, _ = db.Pool.Exec(ctx, "SELECT pg_drop_replication_slot($1)", cdc.DefaultSlotIn(database, db.Names()))
		_, _ = db.Pool.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{cdc.DefaultPublication(db.Names())}.Sanitize())
	}()

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

	rd, err := kgo.NewClient(kgo.SeedBrokers(broker.Addrs()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rd.Close()
	for n := 0; n < 2 && ctx.Err() == nil; {
		rd.PollFetches(ctx).EachRecord(func(rec *kgo.Record) {
			env, err := envelope.Decode(rec.Value)
			if err != nil {
				fmt.Println(err)
				return
			}
			n++
			fmt.Println(string(rec.Key), env.Type, env.Origin)
		})
	}
	// The rows are marked after the broker confirmed them: poll until then.
	var pending int
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL").Scan(&pending); err != nil || pending == 0 {
			break
		}
	}
	fmt.Println("unpublished rows:", pending)
	// Output:
	// P-2026-000123 comanda.creada comandes
	// P-2026-000123 comanda.pagada comandes
	// unpublished rows: 0
}
