package system

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// The services' default retry budget outlasts a short outage: a lock held on
// the effect's table (every attempt fails with lock_not_available, a
// transient error) for 25 times the first backoff leaves 0 dead letters and
// every event applied once, with MaxAttemptsDefault. The contract's 3
// attempts (waits of 1 and 2 backoffs) dead-lettered them. Time is scaled:
// backoff 60 ms for 1 s, so the 1.5 s lock stands for 25 s.
func TestDefaultRetryBudgetOutlastsALock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewMigratedSchema(t)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE efectes (id TEXT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	const topic = "comandes.esdeveniments"
	b := kafkatest.New(t, topic)
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: b.Addrs(), Group: "inventari.descompte_estoc", Topics: []string{topic},
		KgoOpts: []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{Source: src, Pool: db.Pool, Names: db.Names(), Name: "inventari.descompte_estoc",
		Inbox: inbox.New(inbox.Config{Names: db.Names()}), MaxAttempts: MaxAttemptsDefault, Backoff: 60 * time.Millisecond,
		Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '50ms'`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO efectes VALUES ($1)`, m.Envelope.ID)
			return err
		}})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })

	// The outage: a transaction holds the table for 1.5 s.
	lock, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(ctx, `LOCK TABLE efectes IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var msgs []*transport.Message
	for i := 0; i < 5; i++ {
		e := &envelope.Envelope{ID: uuid.NewString(), Type: "comanda.creada", Version: 1, TimeMS: time.Now().UnixMilli(),
			Origin: "comandes", Data: json.RawMessage(`{}`)}
		v, err := e.Encode()
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, &transport.Message{Topic: topic, Key: []byte(e.ID), Value: v,
			Headers: []transport.Header{{Key: "tipus", Value: e.Type}, {Key: "id_esdeveniment", Value: e.ID}}})
	}
	if err := kafka.NewPublisher(kafkatest.Client(t, b)).Publish(ctx, msgs); err != nil {
		t.Fatal(err)
	}
	// The outage must be felt before it ends.
	testkit.Eventually(t, 30*time.Second, "a first retry during the outage", func() bool { return c.Stats().Retried > 0 })
	time.Sleep(1500 * time.Millisecond) // the outage's length, not a wait for work
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	testkit.Eventuallyf(t, 30*time.Second, "the 5 events processed or dead-lettered", func() (bool, string) {
		st := c.Stats()
		return st.Processed+st.DeadLettered >= 5, fmt.Sprintf("stats %+v", st)
	})
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM efectes`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if st := c.Stats(); st.DeadLettered != 0 || st.Processed != 5 || n != 5 || st.Retried == 0 {
		t.Fatalf("after a 1.5 s lock: %+v, %d effects; want 0 dead letters, 5 processed and applied, and some retries", st, n)
	}
}
