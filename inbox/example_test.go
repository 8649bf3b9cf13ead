package inbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/inbox"
)

// The idempotent consumer's processar_comanda_creada: the key and the stock decrement in one
// transaction, so a redelivered comanda.creada is reported as a duplicate.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_DATABASE_URL"))
	if err != nil {
		slog.Error("database", "err", err)
		return
	}
	defer pool.Close()
	res, err := inbox.Process(ctx, pool, "inventari.descompte_estoc", "6f1c9e2a-0000-4000-8000-000000000001",
		func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `UPDATE estoc SET unitats = unitats - 2 WHERE producte = 'formatge-curat' AND unitats >= 2`)
			return err
		})
	fmt.Println(res, err) // processat <nil>, then duplicat <nil> for the same id
}
