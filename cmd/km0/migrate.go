package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay/cdc"
)

func init() {
	register(&command{name: "migrate", summary: "apply the outbox, inbox and per-key order migrations (safe to repeat and to run concurrently)", run: runMigrate})
}

func runMigrate(ctx context.Context, args []string) error {
	fs := cli.NewFlags("migrate", "apply km0's embedded, versioned migrations to a database")
	dbURL := cli.DatabaseURLFlag(fs)
	schema := fs.String("schema", migrate.SchemaDefault, "PostgreSQL schema for km0's tables")
	outboxT := fs.String("outbox-table", migrate.OutboxDefault, "outbox table name")
	inboxT := fs.String("inbox-table", migrate.ProcessatsDefault, "processed-messages table name")
	outboxMode := fs.String("outbox-mode", string(outbox.ModeTable), "table: events are outbox rows; "+
		"wal: events are WAL messages (pg_logical_emit_message), and the outbox's publication and replication slot "+
		"are created here, before anything may be written (needs wal_level = logical and the REPLICATION privilege)")
	slot := fs.String("slot", "", "--outbox-mode wal: the replication slot (default km0_wal_<database>_<schema>_<table>, the relay's default)")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	switch {
	case *outboxMode != string(outbox.ModeTable) && *outboxMode != string(outbox.ModeWAL):
		return fmt.Errorf("--outbox-mode %q: want %s or %s", *outboxMode, outbox.ModeTable, outbox.ModeWAL)
	case *slot != "" && *outboxMode != string(outbox.ModeWAL):
		return errors.New("--slot applies to --outbox-mode wal only")
	case *slot != "" && !cdc.ValidSlot(*slot):
		return fmt.Errorf("--slot %q: a slot name is 1 to 63 lower-case letters, digits and underscores", *slot)
	}
	pool, err := cli.OpenPool(ctx, *dbURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	names := migrate.Names{Schema: *schema, Outbox: *outboxT, Processats: *inboxT}
	n, err := migrate.Up(ctx, pool, names, migrate.Outbox, migrate.Inbox, keyorder.Migrations)
	if err != nil {
		return err
	}
	fmt.Printf("migrate: %d file(s) applied to schema %s\n", n, *schema)
	if *outboxMode != string(outbox.ModeWAL) {
		return nil
	}
	if *slot == "" {
		var db string
		if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
			return err
		}
		*slot = migrate.WALSlot(db, names)
	}
	created, err := migrate.EnsureWALSlot(ctx, pool, *slot, "")
	if err != nil {
		return err
	}
	if created {
		fmt.Printf("migrate: WAL-mode outbox %s.%s: publication and replication slot %s created\n", names.WithDefaults().Schema, names.WithDefaults().Outbox, *slot)
	} else {
		fmt.Printf("migrate: WAL-mode outbox %s.%s: replication slot %s exists\n", names.WithDefaults().Schema, names.WithDefaults().Outbox, *slot)
	}
	return nil
}
