package doctor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/relay"
)

// pgVersionMin is the oldest PostgreSQL km0 runs on (pg_current_xact_id,
// pgoutput's messages of the WAL outbox: 14).
const pgVersionMin = 140000

// checkPostgres checks the server of cfg.DatabaseURL: the connection and
// its TLS, the version, and by the relay mode wal_level, REPLICATION and the
// slots (cdc) or LISTEN through a pooler (polling). Every statement goes by
// the simple protocol, which a transaction-pooling PgBouncer accepts.
func checkPostgres(ctx context.Context, r *Report, cfg Config) {
	target := redact.URL(cfg.DatabaseURL)
	ccfg, err := pgx.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		r.fail("postgres connection", "--database-url", "not a PostgreSQL URL (not shown: it may hold a password)", "give a postgres:// URL or keyword/value string")
		return
	}
	ccfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	target = fmt.Sprintf("%s:%d/%s", ccfg.Host, ccfg.Port, ccfg.Database)
	var conn *pgx.Conn
	err = cfg.withTimeout(ctx, func(ctx context.Context) (err error) {
		conn, err = pgx.ConnectConfig(ctx, ccfg)
		return err
	})
	if err != nil {
		r.fail("postgres connection", target, scrub(err.Error(), ccfg.Password),
			"check the host, port, user and password of --database-url ($KM0_DATABASE_URL), and its sslmode/sslrootcert when the server requires TLS")
		return
	}
	defer conn.Close(context.WithoutCancel(ctx))

	var (
		ssl                 bool
		sslVersion, version string
		versionNum          int
		walLevel            string
		super, repl         bool
		user                string
		now                 time.Time
	)
	before := time.Now()
	err = conn.QueryRow(ctx, `SELECT coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false),
		coalesce((SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid()), ''),
		current_setting('server_version'), current_setting('server_version_num')::int, current_setting('wal_level'),
		r.rolsuper, r.rolreplication, r.rolname, clock_timestamp()
		FROM pg_roles r WHERE r.rolname = current_user`).Scan(&ssl, &sslVersion, &version, &versionNum, &walLevel, &super, &repl, &user, &now)
	local := before.Add(time.Since(before) / 2)
	if err != nil {
		r.fail("postgres connection", target, "connected, but the server's settings could not be read: "+scrub(err.Error(), ccfg.Password), "grant the user read access to pg_roles and pg_stat_ssl")
		return
	}
	tlsSeen := "TLS " + sslVersion
	if ccfg.TLSConfig != nil && !ccfg.TLSConfig.InsecureSkipVerify {
		tlsSeen += ", server certificate verified"
	}
	switch {
	case !ssl && !loopback(ccfg.Host):
		r.warn("postgres connection", target, "connected without TLS as "+user, "add sslmode=verify-full&sslrootcert=<CA file> to --database-url: the password and the events cross the network in clear")
	case !ssl:
		r.ok("postgres connection", target, "connected as "+user+" (no TLS, loopback)")
	case ccfg.TLSConfig != nil && ccfg.TLSConfig.InsecureSkipVerify && loopback(ccfg.Host):
		r.ok("postgres connection", target, "connected as "+user+", TLS "+sslVersion+" (certificate not verified, loopback)")
	case ccfg.TLSConfig != nil && ccfg.TLSConfig.InsecureSkipVerify:
		r.warn("postgres connection", target, "TLS without verifying the server's certificate as "+user, "use sslmode=verify-full with sslrootcert=<CA file>")
	default:
		r.ok("postgres connection", target, "connected as "+user+", "+tlsSeen)
	}
	clockSkew(r, "postgres clock", target, now, local, 0, cfg.MaxSkew)
	if versionNum < pgVersionMin {
		r.fail("postgres version", target, version, "upgrade PostgreSQL to 14 or later")
	} else {
		r.ok("postgres version", target, version)
	}
	if cfg.RelayMode == system.RelayCDC {
		checkCDC(ctx, r, conn, target, walLevel, user, super || repl)
		return
	}
	r.ok("postgres wal_level", target, walLevel+" (the polling relay needs no particular level)")
	checkListen(ctx, r, cfg, ccfg, target)
}

// checkCDC checks what the cdc relay and the WAL outbox need: wal_level =
// logical, the REPLICATION privilege, and slots that still hold their WAL.
func checkCDC(ctx context.Context, r *Report, conn *pgx.Conn, target, walLevel, user string, replication bool) {
	if walLevel != "logical" {
		r.fail("postgres wal_level", target, walLevel+" (--relay cdc and --outbox wal need logical)",
			"ALTER SYSTEM SET wal_level = logical and restart PostgreSQL (RDS/Aurora: rds.logical_replication = 1 in the parameter group; Cloud SQL: cloudsql.logical_decoding = on); or run the relays with --relay polling")
	} else {
		r.ok("postgres wal_level", target, walLevel)
	}
	if !replication {
		r.fail("postgres privileges", target, "user "+user+" has no REPLICATION privilege (--relay cdc opens replication connections)",
			"ALTER ROLE "+pgx.Identifier{user}.Sanitize()+" REPLICATION (RDS: GRANT rds_replication TO the user; Cloud SQL: ALTER USER ... WITH REPLICATION)")
	} else {
		r.ok("postgres privileges", target, "user "+user+" may replicate")
	}
	rows, err := conn.Query(ctx, `SELECT slot_name, coalesce(wal_status, ''), active FROM pg_replication_slots ORDER BY slot_name`)
	if err != nil {
		r.fail("postgres slots", target, "pg_replication_slots could not be read: "+err.Error(), "grant the user pg_read_all_stats or run the doctor as the relays' user")
		return
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var name, status string
		var active bool
		if err := rows.Scan(&name, &status, &active); err != nil {
			r.fail("postgres slots", target, err.Error(), "-")
			return
		}
		n++
		slot := target + " slot " + name
		switch status {
		case "lost":
			r.fail("postgres slot", slot, "wal_status lost: the server removed WAL the slot's relay had not read; the relay can no longer stream from it",
				"drop the slot (SELECT pg_drop_replication_slot('"+name+"')) and restart its relay, which creates it again; replay the events written meanwhile from the outbox (km0 outbox); raise max_slot_wal_keep_size")
		case "unreserved":
			r.fail("postgres slot", slot, "wal_status unreserved: the slot is past max_slot_wal_keep_size and loses its WAL at the next checkpoint",
				"start or unblock the slot's relay now, or raise max_slot_wal_keep_size")
		case "extended":
			r.warn("postgres slot", slot, "wal_status extended: the slot keeps more WAL than max_wal_size", "check that the slot's relay runs and keeps up (km0 lag)")
		default:
			seen := "wal_status " + status
			if !active {
				seen += ", no relay streaming now"
			}
			r.ok("postgres slot", slot, seen)
		}
	}
	if err := rows.Err(); err != nil {
		r.fail("postgres slots", target, err.Error(), "-")
		return
	}
	if n == 0 {
		r.ok("postgres slots", target, "none yet (each cdc relay creates its own at start)")
	}
}

// checkListen runs the relay's LISTEN self-test through the connection of
// --database-url: a pooler in transaction mode loses the notifications.
func checkListen(ctx context.Context, r *Report, cfg Config, ccfg *pgx.ConnConfig, target string) {
	err := relay.CheckListen(ctx, ccfg, cfg.ListenWait)
	switch {
	case err == nil:
		r.ok("postgres LISTEN", target, "a NOTIFY arrived")
	case errors.Is(err, relay.ErrNoNotification):
		r.fail("postgres LISTEN", target, fmt.Sprintf("a NOTIFY never arrived within %v: a transaction-pooling PgBouncer or another pooler is in between", cfg.ListenWait),
			"point the relays at PostgreSQL directly or at a session-pooling PgBouncer (pool_mode = session); else they fall back to polling every --poll, with a warning")
	default:
		r.fail("postgres LISTEN", target, scrub(err.Error(), ccfg.Password), "let the user LISTEN and NOTIFY on this database")
	}
}

// loopback reports whether host is this machine (or a Unix socket).
func loopback(host string) bool {
	if strings.HasPrefix(host, "/") || host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// scrub removes secret from s, should a driver's error quote it.
func scrub(s, secret string) string {
	if secret == "" {
		return s
	}
	return strings.ReplaceAll(s, secret, "xxxxx")
}
