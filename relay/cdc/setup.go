package cdc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/migrate"
)

// ErrSetup is wrapped by every error about a server, role, publication or
// slot that cannot serve the CDC relay. Run returns it at once, with the fix
// in the message, instead of retrying.
var ErrSetup = errors.New("cdc: not set up for CDC")

// Check verifies, on the relay's database, what the CDC relay needs before
// it starts: wal_level = logical, a role with the REPLICATION privilege (or
// a superuser), and the outbox table. The error wraps ErrSetup and names
// every missing setting and privilege with its fix. Run calls it first.
func (r *Relay) Check(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.connCfg)
	if err != nil {
		return fmt.Errorf("cdc: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return r.check(ctx, conn)
}

// CheckServer is Check before a Relay exists (the command line runs it
// before it connects to the broker): the server behind pool, for the outbox
// of names. The relay itself warns about an unlimited max_slot_wal_keep_size when
// it starts; log is unused otherwise (nil is fine).
func CheckServer(ctx context.Context, pool *pgxpool.Pool, names migrate.Names, log *slog.Logger) error {
	cfg := Config{}
	cfg.Names, cfg.Logger = names, log
	if log == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cfg = cfg.WithDefaults()
	cfg.Slot = DefaultSlot(cfg.Names) // only named in a warning
	r := &Relay{cfg: cfg, q: newQueries(cfg.Names, cfg.DeletePublished, false)}
	r.warnedKeep.Store(true) // the relay warns when it starts
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("cdc: connect: %w", err)
	}
	defer conn.Release()
	return r.check(ctx, conn.Conn())
}

func (r *Relay) check(ctx context.Context, conn *pgx.Conn) error {
	var level, keep, role string
	var replication, exists bool
	err := conn.QueryRow(ctx, `SELECT current_setting('wal_level'), current_setting('max_slot_wal_keep_size'),
		current_user, (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
		to_regclass($1) IS NOT NULL`, r.q.table).Scan(&level, &keep, &role, &replication, &exists)
	if err != nil {
		return fmt.Errorf("cdc: check the server: %w", err)
	}
	var missing []string
	if level != "logical" {
		missing = append(missing, fmt.Sprintf("the server has wal_level = %s, and CDC needs wal_level = logical "+
			"(ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)", level))
	}
	if !replication {
		missing = append(missing, fmt.Sprintf("role %s lacks the REPLICATION privilege (ALTER ROLE %s REPLICATION)",
			role, pgx.Identifier{role}.Sanitize()))
	}
	if !exists {
		missing = append(missing, fmt.Sprintf("table %s does not exist (run km0 migrate first)", r.q.table))
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s", ErrSetup, strings.Join(missing, "; "))
	}
	if keep == "-1" && !r.warnedKeep.Swap(true) {
		r.cfg.Logger.Warn("cdc: max_slot_wal_keep_size is unlimited (-1): if this relay stops for long, its slot keeps "+
			"WAL until the disk fills; set a limit (ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'; SELECT pg_reload_conf()) "+
			"and watch "+MetricSlotRetained, "slot", r.cfg.Slot)
	}
	return nil
}

// ensurePublication creates the publication (inserts of the outbox only) if
// it does not exist, and checks that an existing one publishes the outbox's
// inserts.
func (r *Relay) ensurePublication(ctx context.Context, conn *pgx.Conn) error {
	pub := pgx.Identifier{r.cfg.Publication}.Sanitize()
	var insert bool
	err := conn.QueryRow(ctx, "SELECT pubinsert FROM pg_publication WHERE pubname = $1", r.cfg.Publication).Scan(&insert)
	if errors.Is(err, pgx.ErrNoRows) {
		_, err = conn.Exec(ctx, "CREATE PUBLICATION "+pub+" FOR TABLE "+r.q.table+" WITH (publish = 'insert')")
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			r.cfg.Logger.Info("cdc: publication created", "publication", r.cfg.Publication, "outbox", r.q.payload)
			return nil
		case errors.As(err, &pgErr) && pgErr.Code == "42501": // insufficient_privilege
			return fmt.Errorf("%w: cannot create publication %s: the relay's role does not own %s; "+
				"create it as the owner: CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert')",
				ErrSetup, r.cfg.Publication, r.q.payload, pub, r.q.table)
		case errors.As(err, &pgErr) && pgErr.Code == "42710": // duplicate_object: created meanwhile
			return fmt.Errorf("cdc: publication %s was created meanwhile; checking it again", r.cfg.Publication)
		default:
			return fmt.Errorf("cdc: create publication: %w", err)
		}
	}
	if err != nil {
		return fmt.Errorf("cdc: read publication: %w", err)
	}
	var has bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
		r.cfg.Publication, r.cfg.Names.Schema, r.cfg.Names.Outbox).Scan(&has); err != nil {
		return fmt.Errorf("cdc: read publication: %w", err)
	}
	switch {
	case !has:
		return fmt.Errorf("%w: publication %s exists but does not publish %s (ALTER PUBLICATION %s ADD TABLE %s)",
			ErrSetup, r.cfg.Publication, r.q.payload, pub, r.q.table)
	case !insert:
		return fmt.Errorf("%w: publication %s does not publish inserts (ALTER PUBLICATION %s SET (publish = 'insert'))",
			ErrSetup, r.cfg.Publication, pub)
	}
	return nil
}

// slotState reads the slot: whether it exists and the position a stream
// resumes from (confirmed_flush_lsn), and an ErrSetup error, naming the
// slot's database and plugin, when it is not a pgoutput slot of this
// database. That error never suggests dropping the slot: it may be another
// database's relay's.
func (r *Relay) slotState(ctx context.Context, conn *pgx.Conn) (bool, pglogrepl.LSN, error) {
	var plugin, slotType, database, here, resume string
	err := conn.QueryRow(ctx, `SELECT coalesce(plugin, ''), slot_type, coalesce(database::text, ''), current_database(),
		coalesce(confirmed_flush_lsn, '0/0')::text
		FROM pg_replication_slots WHERE slot_name = $1`, r.cfg.Slot).Scan(&plugin, &slotType, &database, &here, &resume)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, 0, r.checkLegacySlot(ctx, conn)
	}
	if err != nil {
		return false, 0, fmt.Errorf("cdc: read slot: %w", err)
	}
	if slotType != "logical" || plugin != "pgoutput" || database != here {
		owner := fmt.Sprintf("a %s slot of database %q with plugin %q", slotType, database, plugin)
		if database == "" {
			owner = fmt.Sprintf("a %s slot of no database", slotType)
		}
		return false, 0, fmt.Errorf("%w: slot %s is %s, not a pgoutput slot of this database (%q): "+
			"it belongs to someone else; give this relay its own slot (--slot)", ErrSetup, r.cfg.Slot, owner, here)
	}
	lsn, err := pglogrepl.ParseLSN(resume)
	if err != nil {
		return false, 0, fmt.Errorf("cdc: slot %s: confirmed_flush_lsn %q: %w", r.cfg.Slot, resume, err)
	}
	return true, lsn, nil
}

// checkLegacySlot refuses to create the defaulted slot while the outbox's
// slot of the older default name (DefaultSlot, without the database) exists
// in this database: a new slot would leave that one holding WAL forever.
func (r *Relay) checkLegacySlot(ctx context.Context, conn *pgx.Conn) error {
	if r.legacySlot == "" {
		return nil
	}
	var here bool
	err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots
		WHERE slot_name = $1 AND database = current_database() AND plugin = 'pgoutput')`, r.legacySlot).Scan(&here)
	if err != nil {
		return fmt.Errorf("cdc: read slot: %w", err)
	}
	if here {
		return fmt.Errorf("%w: this outbox's slot has the name of older km0 versions, %s (the default is now %s, "+
			"named after the database too: slots are server-wide); pass --slot %s (Config.Slot) to keep its position",
			ErrSetup, r.legacySlot, r.cfg.Slot, r.legacySlot)
	}
	return nil
}
