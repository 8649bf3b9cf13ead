package dlq_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/amqpdlq"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// One index over both brokers (dlq.MixedBackend): a Kafka letter in
// comandes.esdeveniments.dlq and a RabbitMQ letter in the DLQ of an ordered
// consumer (dead from its shard queue <queue>.1) are both indexed; a replay
// sends each back to its own broker (the Kafka topic gains one record, the
// shard queue holds one message); a purge with record deletion deletes on
// Kafka only and does not fail for the RabbitMQ letter.
func TestMixedBackendIndexesReplaysAndPurgesOnEachBroker(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	kafkaID, _ := b.produceDead(t, dead{topic: comandes, key: "P-2026-000001", reason: "permanent: esquema: falta mercat"})

	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.dlqmix")
	topo := amqp.SourceConfig{Queue: queue, Shards: 2}.Topology()
	amqptest.DeleteQueuesAtCleanup(t, topo.QueueNames)
	if err := conn.Declare(ctx, topo); err != nil {
		t.Fatal(err)
	}
	dlx, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: amqp.DLXDefault, ExchangeKind: amqp091.ExchangeDirect})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dlx.Close() })
	id, now := uuid.NewString(), time.Now()
	shard := amqp.ShardQueueName(queue, 1)
	if err := dlx.Publish(ctx, []*transport.Message{{Topic: queue, Key: []byte("P-2026-000002"), Value: event(t, id, now),
		Headers: []transport.Header{{Key: contract.HeaderEventID, Value: id}, {Key: contract.HeaderType, Value: "comanda.creada"},
			{Key: contract.HeaderAttempts, Value: "3"}, {Key: contract.HeaderReason, Value: "transitori esgotat: mapes: 503"},
			{Key: amqp.HeaderOriginQueue, Value: shard}, {Key: contract.HeaderDeadAt, Value: contract.FormatTime(now)}}}}); err != nil {
		t.Fatal(err)
	}

	rabbit, err := amqpdlq.New(amqpdlq.Config{Conn: conn, Queues: []string{queue}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rabbit.Close() })
	if _, err := dlq.NewMixedBackend(nil, rabbit); err == nil {
		t.Fatal("a MixedBackend without Kafka must be refused")
	}
	mixed, err := dlq.NewMixedBackend(b.backend, rabbit)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: b.store, Backend: mixed, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	res, err := svc.Sync(ctx)
	if err != nil || len(res.New) != 2 {
		t.Fatalf("sync: %v, %d new letters, want 2", err, len(res.New))
	}
	ls, err := svc.List(ctx, dlq.Filter{})
	if err != nil || len(ls.Letters) != 2 {
		t.Fatalf("list: %v %+v", err, ls)
	}
	var rabbitID string
	for _, l := range ls.Letters {
		if l.Topic == contract.DLQName(queue) {
			rabbitID = l.ID
			if l.OriginalTopic != shard {
				t.Fatalf("RabbitMQ letter's original queue %q, want %q", l.OriginalTopic, shard)
			}
		}
	}
	if rabbitID == "" {
		t.Fatalf("no letter of %s in %+v", contract.DLQName(queue), ls.Letters)
	}

	before := b.records(t, comandesRetry)
	rep, err := svc.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
	if err != nil || rep.Done != 2 {
		t.Fatalf("replay: %v %+v", err, rep)
	}
	if n := b.records(t, comandesRetry) - before; n != 1 {
		t.Errorf("%s gained %d records, want 1 (the Kafka letter, addressed to its group)", comandesRetry, n)
	}
	if n := amqptest.QueueLen(t, conn, shard); n != 1 {
		t.Errorf("%s holds %d messages, want 1 (the RabbitMQ letter)", shard, n)
	}

	prep, err := svc.Purge(ctx, dlq.Filter{IDs: []string{kafkaID, rabbitID}}, dlq.PurgeOptions{Confirmed: true, DeleteRecords: true})
	if err != nil {
		t.Fatalf("purge: %v", err)
	}
	if len(prep.Deleted) != 1 || prep.Deleted[0].Topic != comandesDLQ {
		t.Fatalf("deleted %+v, want records of %s only", prep.Deleted, comandesDLQ)
	}
	if n := b.rows(t, dlq.StatePurged); n != 2 {
		t.Fatalf("%d letters purged, want 2", n)
	}
}
