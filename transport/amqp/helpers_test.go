package amqp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// bundle is what a test needs: a connection, a migrated schema with an
// effects table, a pool on it, and a unique queue name.
type bundle struct {
	conn  *amqp.Conn
	db    *pgtest.Schema
	pool  *pgxpool.Pool // synchronous_commit off: these tests are about the broker, not PostgreSQL's fsync
	queue string
}

func setup(t *testing.T) *bundle {
	t.Helper()
	conn := amqptest.Dial(t)
	db := pgtest.NewMigratedSchema(t)
	if _, err := db.Pool.Exec(context.Background(),
		`CREATE TABLE efectes (n BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, clau TEXT, seq INT, instancia INT)`); err != nil {
		t.Fatal(err)
	}
	pool := pgtest.NewPool(t, db.URL+"&synchronous_commit=off", 6)
	return &bundle{conn: conn, db: db, pool: pool, queue: amqptest.Name("t.amqp")}
}

// payload is the dades of the test events.
type payload struct {
	Key string `json:"clau"`
	Seq int    `json:"seq"`
}

// event returns an envelope message for topic with a fresh id.
func event(t testing.TB, topic, key string, seq int) *transport.Message {
	t.Helper()
	data, _ := json.Marshal(payload{Key: key, Seq: seq})
	e := &envelope.Envelope{ID: uuid.NewString(), Type: "prova.feta", Version: 1, TimeMS: time.Now().UnixMilli(), Origin: "test", Data: data}
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return &transport.Message{Topic: topic, Key: []byte(key), Value: b,
		Headers: []transport.Header{{Key: contract.HeaderType, Value: e.Type}, {Key: contract.HeaderEventID, Value: e.ID}}}
}

// recordEffect is the effect of the test handlers: one row per processing.
func recordEffect(ctx context.Context, tx pgx.Tx, m *consumer.Message, instance int) error {
	var p payload
	if err := m.Envelope.DataAs(&p); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO efectes (id, clau, seq, instancia) VALUES ($1, $2, $3, $4)`, m.Envelope.ID, p.Key, p.Seq, instance)
	return err
}

func countEffects(t testing.TB, db *pgtest.Schema) (rows, distinct int) {
	t.Helper()
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT id) FROM efectes`).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	return rows, distinct
}

// consumerConfig is a consumer on RabbitMQ in these tests: the fields of
// the source (amqp.SourceConfig) and of the pipeline (consumer.Config) that
// the tests set, in one literal.
type consumerConfig struct {
	// the source's
	Conn                *amqp.Conn
	Queue               string
	Exchange            string
	RoutingKeys         []string
	Shards              int
	Instance, Instances int
	StandbyDelay        time.Duration
	Prefetch, Workers   int
	WaitQueueExpiry     time.Duration
	// the pipeline's
	Pool        *pgxpool.Pool
	Inbox       *inbox.Inbox
	Name        string
	Handler     consumer.Handler
	HandleBatch consumer.BatchHandler
	Types       []string
	Mode        consumer.Mode
	Decode      func([]byte) (*envelope.Envelope, error)
	MaxAttempts int
	BackoffBase time.Duration
	BackoffMax  time.Duration
	BatchSize   int
	// ShutdownTimeout bounds how long a stop lets the work in hand run.
	ShutdownTimeout time.Duration
	Logger          *slog.Logger
	// Hooks are crash points (internal/faults), carried in Run's context.
	Hooks faults.Consumer[*consumer.Message]
}

// testConsumer is a running consumer and its source.
type testConsumer struct {
	*consumer.Consumer
	src *amqp.Source
}

// Queues returns the queues the source declared.
func (c *testConsumer) Queues() []string { return c.src.Queues() }

// newConsumer builds the source (declaring its topology) and the consumer.
func newConsumer(ctx context.Context, cfg consumerConfig) (*testConsumer, error) {
	src, err := amqp.NewSource(ctx, amqp.SourceConfig{Conn: cfg.Conn, Queue: cfg.Queue, Exchange: cfg.Exchange,
		RoutingKeys: cfg.RoutingKeys, Shards: cfg.Shards, Instance: cfg.Instance, Instances: cfg.Instances,
		StandbyDelay: cfg.StandbyDelay, Prefetch: cfg.Prefetch, Workers: cfg.Workers, WaitQueueExpiry: cfg.WaitQueueExpiry})
	if err != nil {
		return nil, err
	}
	c, err := consumer.New(consumer.Config{Source: src, Pool: cfg.Pool, Inbox: cfg.Inbox, Name: cfg.Name,
		Handle: cfg.Handler, HandleBatch: cfg.HandleBatch, Types: cfg.Types, Mode: cfg.Mode, Decode: cfg.Decode,
		MaxAttempts: cfg.MaxAttempts, Backoff: cfg.BackoffBase, BackoffMax: cfg.BackoffMax, BatchSize: cfg.BatchSize,
		ShutdownTimeout: cfg.ShutdownTimeout, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	return &testConsumer{Consumer: c, src: src}, nil
}

// startConsumer builds and runs a consumer until the test ends; its queues
// are deleted at cleanup. It returns the consumer and a stop function that
// cancels it and waits for Run to return.
func startConsumer(t *testing.T, cfg consumerConfig) (*testConsumer, func()) {
	t.Helper()
	ctx := context.Background()
	c, err := newConsumer(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	amqptest.DeleteQueuesAtCleanup(t, c.Queues)
	r := testkit.Start(t, "consumer Run", func(ctx context.Context) error {
		return c.Run(faults.WithConsumer(ctx, cfg.Hooks))
	})
	stop := sync.OnceFunc(func() {
		if err := r.Stop(); err != nil && !errors.Is(err, transport.ErrClosed) {
			t.Errorf("consumer Run: %v", err)
		}
	})
	t.Cleanup(stop)
	return c, stop
}

// getAll drains queue with basic.get (auto-ack) and returns its messages.
func getAll(t testing.TB, conn *amqp.Conn, queue string) []amqp091.Delivery {
	t.Helper()
	var out []amqp091.Delivery
	err := conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		for {
			d, ok, err := ch.Get(queue, true)
			if err != nil || !ok {
				return err
			}
			out = append(out, d)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// queueLen returns the number of ready messages in queue.
func queueLen(t testing.TB, conn *amqp.Conn, queue string) int {
	t.Helper()
	return amqptest.QueueLen(t, conn, queue)
}

// testDLQ reads the DLQ of a work queue without changing it (amqptest).
type testDLQ struct {
	t     testing.TB
	conn  *amqp.Conn
	queue string
}

func newTestDLQ(t testing.TB, conn *amqp.Conn, queue string) *testDLQ {
	return &testDLQ{t: t, conn: conn, queue: queue}
}

func (q *testDLQ) Count(context.Context) (int, error) {
	return amqptest.DLQLen(q.t, q.conn, q.queue), nil
}

func (q *testDLQ) List(context.Context, any) ([]*amqp.DeadLetter, error) {
	return amqptest.DeadLetters(q.t, q.conn, q.queue), nil
}

func (q *testDLQ) Show(_ context.Context, id string) (*amqp.DeadLetter, error) {
	if dl := amqptest.DeadLetter(q.t, q.conn, q.queue, id); dl != nil {
		return dl, nil
	}
	return nil, fmt.Errorf("dead letter %s not in %s", id, contract.DLQName(q.queue))
}
