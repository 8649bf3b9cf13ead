package migrate

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/contract"
)

// WALParkedSuffix names the parking table of a WAL-mode outbox:
// <outbox>_wal_aparcats (migration 005_wal_aparcats.sql).
const WALParkedSuffix = "_wal_aparcats"

// WALPrefix is the prefix of the logical decoding messages of outbox n in
// WAL mode (outbox.ModeWAL): "km0.outbox:<schema>.<table>", for example
// km0.outbox:public.outbox. It is part of the wire contract
// (docs/contract.md). Every outbox of a database has its own prefix, so
// several outboxes share a server and a WAL.
func WALPrefix(n Names) string {
	n = n.WithDefaults()
	return "km0.outbox:" + n.Schema + "." + n.Outbox
}

var slotRe = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// SlotName joins parts with '_' into a replication slot name. When the
// result is a valid slot name (lower-case letters, digits, underscores, at
// most 63 bytes) it is returned as is; otherwise it is lower-cased with every
// other character replaced by '_', cut, and followed by 8 hex digits of a
// hash of the exact parts, so that two different sets of parts never share a
// slot.
func SlotName(parts ...string) string {
	name := strings.Join(parts, "_")
	if slotRe.MatchString(name) {
		return name
	}
	var b strings.Builder
	for _, r := range strings.ToLower(name) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '_' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	s := b.String()
	if len(s) > maxIdentBytes-9 {
		s = s[:maxIdentBytes-9]
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(strings.Join(parts, "\x00")))
	return fmt.Sprintf("%s_%08x", s, h.Sum32())
}

// WALSlot is the default replication slot of the WAL-mode outbox n of
// database: km0_wal_<database>_<schema>_<table> (SlotName). Slots are
// server-wide, hence the database in the name.
func WALSlot(database string, n Names) string {
	n = n.WithDefaults()
	return SlotName("km0_wal", database, n.Schema, n.Outbox)
}

// ErrSlot is wrapped by the errors of EnsureWALSlot about a slot name taken
// by a slot that is not a pgoutput slot of this database.
var ErrSlot = errors.New("migrate: replication slot")

// EnsurePublication creates the publication of a WAL-mode outbox, which
// publishes no table (CREATE PUBLICATION name), if it does not exist. The
// error wraps ErrSlot when the role may not create it (it needs CREATE on
// the database), with the statement to run as the owner.
func EnsurePublication(ctx context.Context, db contract.DBTX, name string) error {
	pub := pgx.Identifier{name}.Sanitize()
	var exists bool
	if err := db.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", name).Scan(&exists); err != nil {
		return fmt.Errorf("migrate: read publication %s: %w", name, err)
	}
	if exists {
		return nil
	}
	_, err := db.Exec(ctx, "CREATE PUBLICATION "+pub)
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &pgErr) && pgErr.Code == "42710": // created meanwhile
		return nil
	case errors.As(err, &pgErr) && pgErr.Code == "42501":
		return fmt.Errorf("%w: cannot create publication %s: the role lacks CREATE on the database; "+
			"create it as the owner: CREATE PUBLICATION %s", ErrSlot, name, pub)
	default:
		return fmt.Errorf("migrate: create publication %s: %w", name, err)
	}
}

// EnsureWALSlot creates the publication (EnsurePublication, named
// publication; "" means slot) and then the logical replication slot (plugin
// pgoutput) of a WAL-mode outbox on db's database if they do not exist, and
// reports whether it created the slot. The publication comes first:
// pgoutput looks it up as of each change it decodes, so a publication
// younger than its slot fails the stream. In WAL mode the slot is the only durable store of the
// events: a message written while no slot holds the WAL is lost, so run
// this (km0 migrate --outbox-mode wal does) before anything may be written.
// db must not be inside a transaction that has written (PostgreSQL refuses
// to create a slot there); a pool is right. It needs wal_level = logical and
// the REPLICATION privilege. The error wraps ErrSlot, naming the owner, when
// the name is taken by a slot of another database or plugin; it never
// suggests dropping it (it may be another database's relay's).
func EnsureWALSlot(ctx context.Context, db contract.DBTX, slot, publication string) (created bool, err error) {
	if !slotRe.MatchString(slot) {
		return false, fmt.Errorf("%w: %q is not a slot name: 1 to 63 lower-case letters, digits and underscores", ErrSlot, slot)
	}
	if publication == "" {
		publication = slot
	}
	for range 2 {
		var plugin, database, here, status string
		err := db.QueryRow(ctx, `SELECT coalesce(plugin, ''), coalesce(database::text, ''), current_database(), coalesce(wal_status, '')
			FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&plugin, &database, &here, &status)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return false, fmt.Errorf("migrate: read slot %s: %w", slot, err)
		case plugin != "pgoutput" || database != here:
			return false, fmt.Errorf("%w: %s belongs to database %q (plugin %q), not to this outbox's database %q; "+
				"choose another slot name for this outbox", ErrSlot, slot, database, plugin, here)
		case status == "lost":
			return false, fmt.Errorf("%w: %s is invalidated (wal_status lost): the events it held are gone; "+
				"once its outbox's writers are stopped, drop it (SELECT pg_drop_replication_slot('%s')) and create it again",
				ErrSlot, slot, slot)
		default:
			return false, nil
		}
		var level string
		if err := db.QueryRow(ctx, "SELECT current_setting('wal_level')").Scan(&level); err != nil {
			return false, fmt.Errorf("migrate: read wal_level: %w", err)
		}
		if level != "logical" {
			return false, fmt.Errorf("%w: cannot create %s: the server has wal_level = %s and a WAL-mode outbox needs "+
				"wal_level = logical (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)", ErrSlot, slot, level)
		}
		if err := EnsurePublication(ctx, db, publication); err != nil {
			return false, err
		}
		_, err = db.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot)
		if err == nil {
			return true, nil
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42710" { // duplicate_object: created meanwhile, read it again
			return false, fmt.Errorf("migrate: create slot %s: %w", slot, err)
		}
	}
	return false, fmt.Errorf("migrate: create slot %s: created and dropped meanwhile", slot)
}
