package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// `km0 relay --exchange X` publishes the outbox to a RabbitMQ exchange with the
// same claim → confirm → mark rule: every row arrives once, with the contract
// headers, and ends marked.
func TestRelayCommandToRabbitMQExchange(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	conn := amqptest.Dial(t)
	exchange, queue := amqptest.Name("km0.test.relay"), amqptest.Name("km0.test.relay.q")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue} })
	ctx := context.Background()
	topo := amqp.Topology{
		Exchanges: []amqp.Exchange{{Name: exchange, Kind: "topic", Durable: true}},
		Queues:    []amqp.Queue{{Name: queue, Durable: true}},
		Bindings:  []amqp.Binding{{Queue: queue, Exchange: exchange, Key: "comandes.esdeveniments"}},
	}
	if err := conn.Declare(ctx, topo); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Do(context.Background(), func(ch *amqp091.Channel) error { return ch.ExchangeDelete(exchange, false, false) })
	})

	ob := outbox.New(outbox.Config{Names: s.Names()})
	ids := map[string]bool{}
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		e := &outbox.Event{Aggregate: "comanda", AggregateID: []string{"P-1", "P-2"}[i%2], Type: "comanda.creada",
			Payload: map[string]int{"i": i}}
		if err := ob.Enqueue(ctx, tx, e); err != nil {
			t.Fatal(err)
		}
		ids[e.ID.String()] = true
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	stop := startRelay(t, "--schema", s.Name, "--topic", "comandes.esdeveniments", "--origin", "comandes",
		"--exchange", exchange, "--amqp-url", amqptest.URL(), "--poll", "20ms")
	got := map[string]bool{}
	err = conn.Do(ctx, func(ch *amqp091.Channel) error {
		deadline := time.Now().Add(30 * time.Second)
		for len(got) < 20 && time.Now().Before(deadline) {
			d, ok, err := ch.Get(queue, true)
			if err != nil {
				return err
			}
			if !ok {
				time.Sleep(10 * time.Millisecond) // polling the queue with a deadline
				continue
			}
			id, _ := d.Headers["id_esdeveniment"].(string)
			if tipus, _ := d.Headers["tipus"].(string); tipus != "comanda.creada" || !ids[id] || got[id] {
				t.Errorf("unexpected message: headers %v", d.Headers)
			}
			got[id] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 20 {
		t.Fatalf("%d of 20 events reached the queue", len(got))
	}
	deadline := time.Now().Add(10 * time.Second)
	for pending := -1; pending != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("%d rows still unmarked", pending)
		}
		if err := s.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL").Scan(&pending); err != nil {
			t.Fatal(err)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("km0 relay: %v", err)
	}
}

// `km0 relay` reads the topic's size limit: a row over it is parked before it
// is sent (so no later row of its aggregate can overtake it in a chunk), and
// the other rows flow.
func TestRelayCommandParksRowsOverTheTopicsLimit(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	b := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{"comandes.esdeveniments"}, MaxMessageBytes: 20_000})
	ctx := context.Background()
	enqueueSized(t, s, []string{"P-1", "P-1", "P-1", "P-2"}, []int{10, 30_000, 10, 10})
	stop := startRelay(t, "--schema", s.Name, "--brokers", strings.Join(b.Addrs(), ","),
		"--topic", "comandes.esdeveniments", "--origin", "comandes", "--poll", "20ms")
	var parked, pending int
	testkit.Eventuallyf(t, 30*time.Second, "one row parked and two pending (the big row and the P-1 row behind it)", func() (bool, string) {
		_ = s.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM outbox_aparcats), (SELECT count(*) FROM outbox WHERE publicat_en IS NULL)").Scan(&parked, &pending)
		return parked == 1 && pending == 2, fmt.Sprintf("parked %d, pending %d", parked, pending)
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if recs := kafkatest.ReadAll(t, b, "comandes.esdeveniments", 2, 10*time.Second); len(recs) != 2 {
		t.Fatalf("%d records on the topic, want 2 (P-1's first row and P-2's)", len(recs))
	}
}

// enqueueSized writes, in one transaction, one event per aggregate of aggs
// with a payload of about sizes[i] bytes.
func enqueueSized(t *testing.T, s *pgtest.Schema, aggs []string, sizes []int) {
	t.Helper()
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: s.Names()})
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		for i, size := range sizes {
			if err := ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: aggs[i], Type: "comanda.creada",
				Payload: map[string]string{"p": strings.Repeat("x", size)}}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// `km0 relay --delete-published` deletes each row once the broker confirmed
// it: the outbox keeps only what is pending, here a parked row and the row
// of its aggregate behind it.
func TestRelayCommandDeletePublishedKeepsOnlyPendingRows(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	b := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{"comandes.esdeveniments"}, MaxMessageBytes: 20_000})
	ctx := context.Background()
	enqueueSized(t, s, []string{"P-1", "P-1", "P-1", "P-2", "P-2"}, []int{10, 30_000, 10, 10, 10})
	stop := startRelay(t, "--schema", s.Name, "--brokers", strings.Join(b.Addrs(), ","),
		"--topic", "comandes.esdeveniments", "--origin", "comandes", "--poll", "20ms", "--delete-published")
	var parked, rows, marked int
	testkit.Eventuallyf(t, 30*time.Second, "one row parked and two rows left (the big row and the P-1 row behind it)", func() (bool, string) {
		_ = s.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM outbox_aparcats), (SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox WHERE publicat_en IS NOT NULL)").Scan(&parked, &rows, &marked)
		return parked == 1 && rows == 2, fmt.Sprintf("parked %d, rows %d", parked, rows)
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if marked != 0 {
		t.Fatalf("%d rows marked, want none (deleted instead)", marked)
	}
	if recs := kafkatest.ReadAll(t, b, "comandes.esdeveniments", 3, 10*time.Second); len(recs) != 3 {
		t.Fatalf("%d records on the topic, want 3 (P-1's first row and P-2's two)", len(recs))
	}
}

// Under a topic limit lower than the client's 1 MiB batches, rows that each
// fit must not be packed into one batch over the limit: Kafka refuses the
// whole batch, and a record resent on its own lands behind later records of
// its partition. 300 rows of ~2 kB of one aggregate under a 10 kB limit: all
// published, none parked, in commit order.
func TestRelayCommandKeepsBatchesWithinTheTopicsLimit(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	b := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{"comandes.esdeveniments"}, MaxMessageBytes: 10_000})
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: s.Names()})
	const n = 300
	for i := range n {
		if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			return ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada",
				Payload: map[string]any{"seq": i, "p": strings.Repeat("x", 2_000)}})
		}); err != nil {
			t.Fatal(err)
		}
	}
	stop := startRelay(t, "--schema", s.Name, "--brokers", strings.Join(b.Addrs(), ","),
		"--topic", "comandes.esdeveniments", "--origin", "comandes", "--poll", "20ms")
	recs := kafkatest.ReadAll(t, b, "comandes.esdeveniments", n, 30*time.Second)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	var parked int
	_ = s.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox_aparcats").Scan(&parked)
	if len(recs) != n || parked != 0 {
		t.Fatalf("%d records, %d parked; want %d and 0", len(recs), parked, n)
	}
	for i, r := range recs {
		var e struct {
			Dades struct{ Seq int } `json:"dades"`
		}
		if err := json.Unmarshal(r.Value, &e); err != nil || e.Dades.Seq != i {
			t.Fatalf("record %d carries seq %d (%v): out of commit order", i, e.Dades.Seq, err)
		}
	}
}

// Bad numbers given to `km0 relay` are refused at once with an error naming
// the flag, even while Kafka is down (before, a negative --batch was reported
// only once the broker answered, and 0 or a negative --partitions silently
// became the default). --batch 0 and --workers 0 are the adaptive defaults,
// not errors. The context only bounds a hang.
func TestRelayCommandRefusesBadNumbersAtOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	for _, bad := range [][]string{{"--batch", "-5"}, {"--batch", "10001"}, {"--workers", "-1"},
		{"--workers", "65"}, {"--partitions", "-2"}, {"--poll", "-1s"}, {"--poll", "0s"}, {"--prune-older-than", "-1s"},
		{"--topic", "bad topic!"}, {"--topic", strings.Repeat("t", 250)}} { // a broker refuses these for good
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := runRelay(ctx, append([]string{"--database-url", pgtest.URL(), "--schema", s.Name, "--brokers", "127.0.0.1:1",
			"--topic", "comandes.esdeveniments", "--origin", "comandes"}, bad...))
		cancel()
		if err == nil || !strings.Contains(err.Error(), bad[0]) {
			t.Errorf("km0 relay %s %s: want an error naming %s, got %v", bad[0], bad[1], bad[0], err)
		}
	}
}

// startRelay runs `km0 relay` with args (the database URL added) until the
// returned stop is called; stop returns the command's error.
func startRelay(t *testing.T, args ...string) (stop func() error) {
	t.Helper()
	return testkit.Start(t, "km0 relay", func(ctx context.Context) error {
		return runRelay(ctx, append([]string{"--database-url", pgtest.URL()}, args...))
	}).Stop
}
