package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/inbox"
)

// What a caller of Process does with its errors: ErrStore means the
// database failed (BEGIN, the key, COMMIT), not the effect, so the message
// is tried again in place and not counted as a failed attempt; ErrEmptyKey
// is a caller's bug. Keys are purged after the retention (Purge), or after
// an age of one's own (PurgeOlderThan), e.g. for a topic kept longer.
func ExampleInbox_Process_errors() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://127.0.0.1/inventari")
	if err != nil {
		log.Fatal(err)
	}
	in := inbox.New(inbox.Config{})
	_, err = in.Process(ctx, pool, "inventari", "6f1c9e2a-0000-4000-8000-000000000001", func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE estoc SET quantitat = quantitat - 1 WHERE producte = 'formatge-curat'`)
		return err
	})
	switch {
	case errors.Is(err, inbox.ErrStore):
		log.Print("database unavailable; retry the same message: ", err)
	case errors.Is(err, inbox.ErrEmptyKey):
		log.Fatal(err)
	}
	n, err := in.PurgeOlderThan(ctx, pool, 30*24*time.Hour)
	fmt.Println(n, err)
}
