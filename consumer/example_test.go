package consumer_test

import (
	"context"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/outcome"
)

// The inventari service: decrement stock once per comanda.creada,
// dead-letter an order that cannot be served.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_DATABASE_URL"))
	if err != nil {
		slog.Error("database", "err", err)
		return
	}
	defer pool.Close()
	c, err := consumer.New(consumer.Config{
		Brokers: []string{"127.0.0.1:9092"},
		Group:   "inventari",
		Topics:  []string{"comandes.esdeveniments"},
		Name:    "inventari.descompte_estoc", // the consumidor of missatges_processats
		Pool:    pool,
		Types:   []string{"comanda.creada"},
		Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
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
		},
	})
	if err != nil {
		slog.Error("config", "err", err)
		return
	}
	if err := c.Run(ctx); err != nil { // until Ctrl-C; commits finished work on the way out
		slog.Error("consumer", "err", err)
	}
}
