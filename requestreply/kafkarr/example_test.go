package kafkarr_test

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// The same authorisation as over RabbitMQ, over Kafka (here the embedded
// broker): requests on pagaments.autoritzacions, each client's replies on
// its own respostes.<random> topic. The retry of a request id gets the
// stored response; the effect ran once.
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
	broker, err := kafkaembed.Start(kafkaembed.Config{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer broker.Close()

	authorise := requestreply.Idempotent(db.Pool, db.Names(), "pagaments.autoritzacio",
		func(ctx context.Context, tx pgx.Tx, req *requestreply.Request) ([]byte, error) {
			var in struct {
				OrderID string `json:"comanda_id"`
				Amount  int    `json:"import_centims"`
			}
			if err := requestreply.DecodeJSON(req.Body, &in); err != nil {
				return nil, err
			}
			var n int
			if err := tx.QueryRow(ctx, `INSERT INTO autoritzacions (comanda_id) VALUES ($1) RETURNING n`, in.OrderID).Scan(&n); err != nil {
				return nil, err
			}
			return json.Marshal(map[string]any{"autoritzacio": fmt.Sprintf("AUT-%d", n), "autoritzada": in.Amount < 100_000})
		})
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: broker.Addrs(), Handler: authorise})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = srv.Run(runCtx) }()

	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: broker.Addrs()})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()
	for range 2 { // the second is a retry of the first
		resp, err := cl.Request(ctx, kafkarr.TopicDefault, "autoritzacio-P-2026-000123",
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
