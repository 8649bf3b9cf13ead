package amqp_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/amqp/amqptest"
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
		Headers: []transport.Header{{Key: transport.HeaderType, Value: e.Type}, {Key: transport.HeaderEventID, Value: e.ID}}}
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

// startConsumer builds and runs a consumer until the test ends; its queues
// are deleted at cleanup. It returns the consumer and a stop function that
// cancels it and waits for Run to return.
func startConsumer(t *testing.T, cfg amqp.ConsumerConfig) (*amqp.Consumer, func()) {
	t.Helper()
	ctx := context.Background()
	c, err := amqp.NewConsumer(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	amqptest.DeleteQueuesAtCleanup(t, c.Queues)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil && !errors.Is(err, transport.ErrClosed) {
			t.Errorf("consumer Run: %v", err)
		}
	}
	t.Cleanup(stop)
	return c, stop
}

var waitFor = amqptest.WaitFor

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
