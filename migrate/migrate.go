// Package migrate applies km0's versioned, embedded SQL migrations.
//
// A Set is a named sequence of files NNN_name.sql. Up applies the files of each
// set that are not yet recorded in the table km0_migracions of the target schema,
// each in its own transaction together with its record row, under a
// transaction-scoped advisory lock: running Up twice, or from several processes
// at once, applies every file exactly once.
//
// Files may use these placeholders, replaced by quoted identifiers (never raw
// configuration text): {{schema}}, {{outbox}}, {{processats}}, and {{schema_lit}}
// for the schema name as a SQL string literal.
package migrate

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/contract"
)

//go:embed sql/outbox/*.sql sql/inbox/*.sql
var coreFS embed.FS

// Defaults for Names.
const (
	SchemaDefault     = "public"
	OutboxDefault     = "outbox"
	ProcessatsDefault = "missatges_processats"
)

// Names are the configurable identifiers of km0's tables. Empty fields take the
// defaults above (the names of CONTRACT.md).
type Names struct {
	Schema     string // default "public"
	Outbox     string // default "outbox"
	Processats string // default "missatges_processats"
}

// WithDefaults returns n with empty fields filled in.
func (n Names) WithDefaults() Names {
	if n.Schema == "" {
		n.Schema = SchemaDefault
	}
	if n.Outbox == "" {
		n.Outbox = OutboxDefault
	}
	if n.Processats == "" {
		n.Processats = ProcessatsDefault
	}
	return n
}

// maxIdentBytes is PostgreSQL's identifier limit (NAMEDATALEN − 1): a longer
// name is silently truncated, so two long outbox names with one prefix would
// share their parking table.
const maxIdentBytes = 63

// Validate reports a name PostgreSQL would truncate or refuse, counting the
// suffixes of the derived tables and indexes (outbox_aparcats_agregat,
// missatges_processats_antiguitat).
func (n Names) Validate() error {
	n = n.WithDefaults()
	for _, c := range []struct{ what, name, derived string }{
		{"schema", n.Schema, n.Schema},
		{"outbox table", n.Outbox, n.Outbox + "_aparcats_agregat"},
		{"processed-messages table", n.Processats, n.Processats + "_antiguitat"},
	} {
		if strings.ContainsRune(c.name, 0) {
			return fmt.Errorf("migrate: %s name %q contains a NUL byte", c.what, c.name)
		}
		if len(c.derived) > maxIdentBytes {
			return fmt.Errorf("migrate: %s name %q is too long: %q is over PostgreSQL's %d bytes",
				c.what, c.name, c.derived, maxIdentBytes)
		}
	}
	return nil
}

// Table returns the quoted, schema-qualified name of table in n's schema.
func (n Names) Table(table string) string {
	n = n.WithDefaults()
	return pgx.Identifier{n.Schema, table}.Sanitize()
}

// Set is a named sequence of migration files.
type Set struct {
	Name string // recorded in km0_migracions.conjunt
	FS   fs.FS  // holds the files
	Dir  string // folder inside FS with the NNN_name.sql files
}

// Outbox is the set that creates the outbox table of CONTRACT.md, its partial
// index, the ordering and NOTIFY triggers and the parking table.
var Outbox = Set{Name: "outbox", FS: coreFS, Dir: "sql/outbox"}

// Inbox is the set that creates missatges_processats of CONTRACT.md.
var Inbox = Set{Name: "inbox", FS: coreFS, Dir: "sql/inbox"}

// lockKey is the advisory lock that serialises concurrent migrators.
const lockKey int64 = 0x6b6d305f6d6967 // "km0_mig"

// Up applies every pending file of sets, in order, and returns how many it
// applied. It creates the schema if absent. It is safe to run twice and
// concurrently. An error leaves the failing file unapplied and unrecorded.
// db is a pool, a connection or a transaction (contract.Beginner).
func Up(ctx context.Context, db contract.Beginner, names Names, sets ...Set) (int, error) {
	names = names.WithDefaults()
	if err := names.Validate(); err != nil {
		return 0, err
	}
	applied := 0
	repl := replacer(names)
	for _, set := range sets {
		files, err := list(set)
		if err != nil {
			return applied, err
		}
		conjunt, err := recordName(set, files, names)
		if err != nil {
			return applied, err
		}
		for _, f := range files {
			done, err := applyOne(ctx, db, names, set, conjunt, f, repl)
			if err != nil {
				return applied, fmt.Errorf("migrate %s/%s: %w", set.Name, f.name, err)
			}
			if done {
				applied++
			}
		}
	}
	return applied, nil
}

type file struct {
	version int
	name    string
}

func list(set Set) ([]file, error) {
	entries, err := fs.ReadDir(set.FS, set.Dir)
	if err != nil {
		return nil, fmt.Errorf("migrate: set %s: %w", set.Name, err)
	}
	var files []file
	seen := map[int]string{}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		num, _, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migrate: set %s: file %q is not named NNN_name.sql", set.Name, e.Name())
		}
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migrate: set %s: %q and %q share version %d", set.Name, prev, e.Name(), v)
		}
		seen[v] = e.Name()
		files = append(files, file{version: v, name: e.Name()})
	}
	sort.Slice(files, func(i, j int) bool { return files[i].version < files[j].version })
	return files, nil
}

// recordName is the conjunt under which the files of set are recorded for
// names: the set's name, followed by the configured table names its files use
// when they are not the defaults. A second outbox (or inbox) table in the same
// schema is then migrated too, instead of being taken for the first one.
func recordName(set Set, files []file, names Names) (string, error) {
	var usesOutbox, usesProcessats bool
	for _, f := range files {
		body, err := fs.ReadFile(set.FS, path.Join(set.Dir, f.name))
		if err != nil {
			return "", err
		}
		for _, p := range []string{"{{outbox", "{{aparcats", "{{wal_aparcats", "{{pendents_name}}", "{{publicats_name}}"} {
			usesOutbox = usesOutbox || strings.Contains(string(body), p)
		}
		usesProcessats = usesProcessats || strings.Contains(string(body), "{{processats")
	}
	name := set.Name
	if usesOutbox && names.Outbox != OutboxDefault {
		name += ":" + names.Outbox
	}
	if usesProcessats && names.Processats != ProcessatsDefault {
		name += ":" + names.Processats
	}
	return name, nil
}

func applyOne(ctx context.Context, db contract.Beginner, names Names, set Set, conjunt string, f file, repl *strings.Replacer) (bool, error) {
	body, err := fs.ReadFile(set.FS, path.Join(set.Dir, f.name))
	if err != nil {
		return false, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit this is a no-op
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey); err != nil {
		return false, err
	}
	schema := pgx.Identifier{names.Schema}.Sanitize()
	track := pgx.Identifier{names.Schema, "km0_migracions"}.Sanitize()
	if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+schema); err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+track+` (
		conjunt TEXT NOT NULL, versio INTEGER NOT NULL, fitxer TEXT NOT NULL,
		aplicada_en TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (conjunt, versio))`); err != nil {
		return false, err
	}
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+track+" WHERE conjunt = $1 AND versio = $2)",
		conjunt, f.version).Scan(&exists); err != nil {
		return false, err
	}
	if exists {
		return false, tx.Commit(ctx)
	}
	// Simple protocol: a migration file may hold several statements.
	if _, err := tx.Exec(ctx, repl.Replace(string(body)), pgx.QueryExecModeSimpleProtocol); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			return false, fmt.Errorf("%s (%s)", pgErr.Message, pgErr.Code)
		}
		return false, err
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+track+" (conjunt, versio, fitxer) VALUES ($1, $2, $3)",
		conjunt, f.version, f.name); err != nil {
		return false, err
	}
	return true, tx.Commit(ctx)
}

func replacer(n Names) *strings.Replacer {
	return strings.NewReplacer(
		"{{schema}}", pgx.Identifier{n.Schema}.Sanitize(),
		"{{schema_lit}}", quoteLiteral(n.Schema),
		"{{outbox}}", pgx.Identifier{n.Schema, n.Outbox}.Sanitize(),
		"{{outbox_name}}", pgx.Identifier{n.Outbox}.Sanitize(),
		"{{outbox_lit}}", quoteLiteral(n.Outbox),
		"{{processats}}", pgx.Identifier{n.Schema, n.Processats}.Sanitize(),
		"{{processats_name}}", pgx.Identifier{n.Processats}.Sanitize(),
		"{{aparcats}}", pgx.Identifier{n.Schema, n.Outbox + "_aparcats"}.Sanitize(),
		"{{aparcats_idx}}", pgx.Identifier{n.Outbox + "_aparcats_agregat"}.Sanitize(),
		"{{wal_aparcats}}", pgx.Identifier{n.Schema, n.Outbox + WALParkedSuffix}.Sanitize(),
		"{{pendents_name}}", pgx.Identifier{n.Outbox + "_pendents"}.Sanitize(),
		"{{publicats_name}}", pgx.Identifier{n.Outbox + "_publicats"}.Sanitize(),
		"{{processats_idx}}", pgx.Identifier{n.Processats + "_antiguitat"}.Sanitize(),
	)
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
