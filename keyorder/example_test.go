package keyorder_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/keyorder"
)

// A consumer in per-key order mode, for one message of key P-2026-000123:
// parked behind the key's head if the key is blocked, applied otherwise; the
// head's success releases what waited behind it, in order, in the same
// transaction.
// Compiled, not run (no Output): it wires a service against its own
// database, so deadcode -test reports it unreachable.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_DATABASE_URL"))
	if err != nil {
		slog.Error("database", "err", err)
		return
	}
	defer pool.Close()
	store, _ := keyorder.New(keyorder.Config{})
	m := keyorder.Message{ID: "01a2316e-6547-7609-8a85-1606738e31e9", Topic: "comandes.esdeveniments", Partition: 3, Offset: 42,
		Value: []byte(`{"tipus":"comanda.cancellada"}`), Headers: []keyorder.Header{{Key: "tipus", Value: "comanda.cancellada"}}}
	apply := func(tx pgx.Tx, id string) error { return nil } // the inbox key and the effect
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		heads, err := store.IsBlocked(ctx, tx, "pagaments.cobrament", "P-2026-000123")
		if err != nil {
			return err
		}
		if h, blocked := heads["P-2026-000123"]; blocked && h.MessageID != m.ID {
			_, _, err := store.Park(ctx, tx, "pagaments.cobrament", "P-2026-000123", m)
			if !errors.Is(err, keyorder.ErrNotBlocked) {
				return err // parked (or failed): settle the offset with this transaction
			}
		}
		if err := apply(tx, m.ID); err != nil {
			return err
		}
		if h, blocked := heads["P-2026-000123"]; blocked && h.MessageID == m.ID { // m was the head
			released, err := store.Release(ctx, tx, "pagaments.cobrament", "P-2026-000123", m.ID)
			if err != nil {
				return err
			}
			for _, p := range released {
				if err := apply(tx, p.ID); err != nil {
					return err
				}
			}
		}
		return nil
	})
	fmt.Println(err)
}
