package amqprr_test

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/transport/amqp"
)

// pagaments answers card authorisations; comandes asks, with the order id
// as request id, so a retry after a timeout is safe: the same request id
// runs the effect once and gets the stored response again.
func Example() {
	ctx := context.Background()
	db, drop, err := pgtest.Temp(ctx) // a fresh schema on the test PostgreSQL
	if err != nil {
		fmt.Println(err)
		return
	}
	defer drop()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox, requestreply.Migrations); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE autoritzacions (n SERIAL PRIMARY KEY, comanda_id TEXT NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}
	conn, err := amqp.Dial(ctx, amqp.Config{URL: amqptest.URL()}) // the machine's RabbitMQ
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()

	authorise := requestreply.Idempotent(db.Pool, db.Names(), "pagaments.autoritzacio",
		func(ctx context.Context, tx pgx.Tx, req *requestreply.Request) ([]byte, error) {
			var in struct {
				OrderID string `json:"comanda_id"`
				Amount  int    `json:"import_centims"`
			}
			if err := requestreply.DecodeJSON(req.Body, &in); err != nil {
				return nil, err // error reply: "bad request: malformed JSON: …"
			}
			var n int
			if err := tx.QueryRow(ctx, `INSERT INTO autoritzacions (comanda_id) VALUES ($1) RETURNING n`, in.OrderID).Scan(&n); err != nil {
				return nil, err
			}
			return json.Marshal(map[string]any{"autoritzacio": fmt.Sprintf("AUT-%d", n), "autoritzada": in.Amount < 100_000})
		})
	queue := fmt.Sprintf("pagaments.autoritzacions.exemple-%d", time.Now().UnixNano())
	srv, err := amqprr.NewServer(ctx, amqprr.ServerConfig{Conn: conn, Queue: queue, Handler: authorise})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer deleteQueues(conn, srv.Queues())
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = srv.Run(runCtx) }()

	cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: conn})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()
	for range 2 { // the second is a retry of the first
		resp, err := cl.Request(ctx, queue, "autoritzacio-P-2026-000123",
			[]byte(`{"comanda_id":"P-2026-000123","import_centims":4250}`))
		fmt.Printf("%s %v\n", resp, err)
	}
	var rows int
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM autoritzacions`).Scan(&rows)
	fmt.Println("authorisations:", rows)
	// Output:
	// {"autoritzacio":"AUT-1","autoritzada":true} <nil>
	// {"autoritzacio":"AUT-1","autoritzada":true} <nil>
	// authorisations: 1
}

// deleteQueues removes the example's queues from the broker.
func deleteQueues(conn *amqp.Conn, names []string) {
	_ = conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		for _, q := range names {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				return err
			}
		}
		return nil
	})
}
