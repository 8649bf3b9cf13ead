package outbox_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
)

// comandes writes the order and its comanda.creada in one transaction; the
// relay publishes the event after the commit. An event that breaks its JSON
// Schema is refused, and the order it came with rolls back with it.
func Example() {
	ctx := context.Background()
	db, drop, err := pgtest.Temp(ctx) // a fresh schema on the test PostgreSQL
	if err != nil {
		fmt.Println(err)
		return
	}
	defer drop()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Outbox); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE comandes (id TEXT PRIMARY KEY, client TEXT NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}

	reg, err := schema.Default() // refuse events that break their JSON Schema
	if err != nil {
		fmt.Println(err)
		return
	}
	ob := outbox.New(outbox.Config{Names: db.Names(), Validate: reg.Validate})
	order := func(id string, quantitat int) error {
		return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO comandes (id, client) VALUES ($1, 'anna')`, id); err != nil {
				return err
			}
			return ob.Enqueue(ctx, tx, &outbox.Event{
				Aggregate: "comanda", AggregateID: id, Type: "comanda.creada", Version: 2,
				Payload: map[string]any{"id": id, "client": "anna", "mercat": "girona",
					"linies": []map[string]any{{"producte": "formatge-curat", "quantitat": quantitat, "preu_centims": 1450}}},
			})
		}) // both rows commit, or neither
	}
	fmt.Println("P-2026-000123:", order("P-2026-000123", 2))
	fmt.Println("P-2026-000124:", order("P-2026-000124", 0))

	var orders, events int
	var tipus, agregat string
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM comandes`).Scan(&orders)
	_ = db.Pool.QueryRow(ctx, `SELECT count(*), min(tipus), min(agregat_id) FROM outbox`).Scan(&events, &tipus, &agregat)
	fmt.Printf("%d order, %d event: %s %s\n", orders, events, tipus, agregat)
	// Output:
	// P-2026-000123: <nil>
	// P-2026-000124: outbox: invalid event: esquema: comanda.creada v2: /linies/0/quantitat: must be >= 1 (got 0)
	// 1 order, 1 event: comanda.creada P-2026-000123
}
