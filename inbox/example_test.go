package inbox_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
)

// The idempotent consumer's processar_comanda_creada: the key and the stock
// decrement in one transaction, so a redelivered comanda.creada is reported
// as a duplicate and decrements nothing.
func Example() {
	ctx := context.Background()
	db, drop, err := pgtest.Temp(ctx) // a fresh schema on the test PostgreSQL
	if err != nil {
		fmt.Println(err)
		return
	}
	defer drop()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE estoc (producte TEXT PRIMARY KEY, unitats INT NOT NULL);
		INSERT INTO estoc VALUES ('formatge-curat', 5)`); err != nil {
		fmt.Println(err)
		return
	}

	in := inbox.New(inbox.Config{Names: db.Names()})
	decrement := func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE estoc SET unitats = unitats - 2 WHERE producte = 'formatge-curat' AND unitats >= 2`)
		return err
	}
	for range 2 { // the broker delivers the same event twice
		res, err := in.Process(ctx, db.Pool, "inventari.descompte_estoc", "6f1c9e2a-0000-4000-8000-000000000001", decrement)
		fmt.Println(res, err)
	}
	var left int
	_ = db.Pool.QueryRow(ctx, `SELECT unitats FROM estoc`).Scan(&left)
	fmt.Println("formatge-curat:", left)
	// Output:
	// processat <nil>
	// duplicat <nil>
	// formatge-curat: 3
}
