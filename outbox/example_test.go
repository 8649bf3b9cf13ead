package outbox_test

import (
	"context"
	"log/slog"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
)

// comandes writes the order, its lines and comanda.creada in one transaction;
// the relay publishes the event after the commit. Nothing here talks to Kafka.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_DATABASE_URL"))
	if err != nil {
		slog.Error("database", "err", err)
		return
	}
	defer pool.Close()
	reg, err := schema.Default() // refuse events that break their JSON Schema
	if err != nil {
		slog.Error("schemas", "err", err)
		return
	}
	ob := outbox.New(outbox.Config{Validate: reg.Validate})
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO comandes (id, client, mercat, estat) VALUES ($1, $2, $3, 'creada')`,
			"P-2026-000123", "anna", "girona"); err != nil {
			return err
		}
		return ob.Enqueue(ctx, tx, &outbox.Event{
			Aggregate: "comanda", AggregateID: "P-2026-000123", Type: "comanda.creada", Version: 1,
			Payload: map[string]any{"id": "P-2026-000123", "client": "anna", "mercat": "girona",
				"linies": []map[string]any{{"producte": "formatge-curat", "quantitat": 2, "preu_centims": 1450}}},
		})
	}) // both rows commit, or neither
	if err != nil {
		slog.Error("order", "err", err)
	}
}
