package main

import (
	"context"
	"fmt"

	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
)

func init() {
	register(&command{name: "migrate", summary: "apply the outbox, inbox and per-key order migrations (safe to repeat and to run concurrently)", run: runMigrate})
}

func runMigrate(ctx context.Context, args []string) error {
	fs := newFlags("migrate", "apply km0's embedded, versioned migrations to a database")
	dbURL := databaseURLFlag(fs)
	schema := fs.String("schema", migrate.SchemaDefault, "PostgreSQL schema for km0's tables")
	outboxT := fs.String("outbox-table", migrate.OutboxDefault, "outbox table name")
	inboxT := fs.String("inbox-table", migrate.ProcessatsDefault, "processed-messages table name")
	if err := parse(fs, args); err != nil {
		return err
	}
	pool, err := openPool(ctx, *dbURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	n, err := migrate.Up(ctx, pool, migrate.Names{Schema: *schema, Outbox: *outboxT, Processats: *inboxT}, migrate.Outbox, migrate.Inbox, keyorder.Migrations)
	if err != nil {
		return err
	}
	fmt.Printf("migrate: %d file(s) applied to schema %s\n", n, *schema)
	return nil
}
