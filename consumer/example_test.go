package consumer_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// descompteEstoc is the inventari handler: decrement stock once per
// comanda.creada, dead-letter an order that cannot be served.
func descompteEstoc(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var d struct {
		Linies []struct {
			Producte  string `json:"producte"`
			Quantitat int    `json:"quantitat"`
		} `json:"linies"`
	}
	if err := m.Envelope.DataAs(&d); err != nil {
		return err // permanent: the payload will not change
	}
	for _, l := range d.Linies {
		tag, err := tx.Exec(ctx, `UPDATE estoc SET unitats = unitats - $1 WHERE producte = $2 AND unitats >= $1`,
			l.Quantitat, l.Producte)
		if err != nil {
			return err // transient by default: retried with backoff
		}
		if tag.RowsAffected() == 0 {
			return outcome.Permanentf("estoc insuficient: %s", l.Producte) // to the DLQ now
		}
	}
	return nil
}

// exampleEvents are three comanda.creada: one of them delivered twice, one
// asking for more cheese than there is.
func exampleEvents() []*transport.Message {
	ev := func(id, order string, quantitat int) *transport.Message {
		v := fmt.Sprintf(`{"id_esdeveniment":%q,"tipus":"comanda.creada","versio":1,"data_ms":1789000000000,"origen":"comandes",`+
			`"dades":{"id":%q,"linies":[{"producte":"formatge-curat","quantitat":%d}]}}`, id, order, quantitat)
		return &transport.Message{Key: []byte(order), Value: []byte(v), Headers: []transport.Header{
			{Key: contract.HeaderType, Value: "comanda.creada"}, {Key: contract.HeaderEventID, Value: id}}}
	}
	first := ev("6f1c9e2a-0000-4000-8000-000000000001", "P-2026-000123", 2)
	return []*transport.Message{first, first, ev("6f1c9e2a-0000-4000-8000-000000000002", "P-2026-000124", 9),
		ev("6f1c9e2a-0000-4000-8000-000000000003", "P-2026-000125", 1)}
}

// exampleDB is a fresh schema with the inbox and 5 units of formatge-curat.
func exampleDB(ctx context.Context) (*pgtest.Schema, func(), error) {
	db, drop, err := pgtest.Temp(ctx)
	if err != nil {
		return nil, nil, err
	}
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox); err == nil {
		_, err = db.Pool.Exec(ctx, `CREATE TABLE estoc (producte TEXT PRIMARY KEY, unitats INT NOT NULL);
			INSERT INTO estoc VALUES ('formatge-curat', 5)`)
		if err == nil {
			return db, drop, nil
		}
	}
	drop()
	return nil, nil, err
}

// runUntilSettled runs c until all 4 deliveries are settled, stops it
// cleanly (it commits finished work on the way out) and prints the outcome.
func runUntilSettled(ctx context.Context, db *pgtest.Schema, c *consumer.Consumer) {
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if st := c.Stats(); st.Processed+st.Duplicates+st.DeadLettered == 4 {
			break
		}
	}
	stop()
	if err := <-done; err != nil {
		fmt.Println(err)
	}
	st := c.Stats()
	var left int
	_ = db.Pool.QueryRow(ctx, `SELECT unitats FROM estoc`).Scan(&left)
	fmt.Printf("processed %d, duplicates %d, dead-lettered %d; formatge-curat left: %d\n",
		st.Processed, st.Duplicates, st.DeadLettered, left)
}

// The inventari consumer over Kafka (here the embedded broker): the
// duplicate is absorbed, the order that cannot be served goes to
// comandes.esdeveniments.dlq, and the stock is decremented exactly once per
// order served.
func Example() {
	ctx := context.Background()
	db, drop, err := exampleDB(ctx) // a fresh schema on the test PostgreSQL
	if err != nil {
		fmt.Println(err)
		return
	}
	defer drop()
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
	msgs := exampleEvents()
	for _, m := range msgs {
		m.Topic = "comandes.esdeveniments"
	}
	if err := kafka.NewPublisher(cl).Publish(ctx, msgs); err != nil {
		fmt.Println(err)
		return
	}

	// The broker is the Source; the rest of Config is the same over
	// RabbitMQ (amqp.NewSource, see the next example).
	src, err := kafka.NewSource(kafka.SourceConfig{
		Brokers: broker.Addrs(),
		Group:   "inventari",
		Topics:  []string{"comandes.esdeveniments"},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	c, err := consumer.New(consumer.Config{
		Source: src,
		Name:   "inventari.descompte_estoc", // the consumidor of missatges_processats
		Pool:   db.Pool,
		Names:  db.Names(),
		Types:  []string{"comanda.creada"},
		Handle: descompteEstoc,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	runUntilSettled(ctx, db, c)
	// Output: processed 2, duplicates 1, dead-lettered 1; formatge-curat left: 2
}

// The same consumer over RabbitMQ: only the Source changes. The work queue
// (here a fresh one on the machine's broker) gets its DLQ, <queue>.dlq,
// behind the km0.dlx exchange.
func Example_rabbitMQ() {
	ctx := context.Background()
	db, drop, err := exampleDB(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer drop()
	conn, err := amqp.Dial(ctx, amqp.Config{URL: amqpURL()})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()
	queue := fmt.Sprintf("inventari.descompte_estoc.exemple-%d", time.Now().UnixNano())
	src, err := amqp.NewSource(ctx, amqp.SourceConfig{Conn: conn, Queue: queue})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer deleteQueues(ctx, conn, src.Queues)
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{}) // default exchange: the routing key names the queue
	if err != nil {
		fmt.Println(err)
		return
	}
	msgs := exampleEvents()
	for _, m := range msgs {
		m.Topic = queue
	}
	if err := pub.Publish(ctx, msgs); err != nil {
		fmt.Println(err)
		return
	}

	c, err := consumer.New(consumer.Config{
		Source: src,
		Name:   "inventari.descompte_estoc",
		Pool:   db.Pool,
		Names:  db.Names(),
		Types:  []string{"comanda.creada"},
		Handle: descompteEstoc,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	runUntilSettled(ctx, db, c)
	// Output: processed 2, duplicates 1, dead-lettered 1; formatge-curat left: 2
}

// amqpURL is the test RabbitMQ (KM0_TEST_AMQP_URL, else the machine's).
func amqpURL() string { return amqptest.URL() }

// deleteQueues removes the example's queues from the broker.
func deleteQueues(ctx context.Context, conn *amqp.Conn, names func() []string) {
	_ = conn.Do(ctx, func(ch *amqp091.Channel) error {
		for _, q := range names() {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				return err
			}
		}
		return nil
	})
}
