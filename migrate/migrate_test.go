package migrate_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
)

func TestUpIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	counts := make([]int, 4)
	errs := make([]error, 4)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			counts[i], errs[i] = migrate.Up(ctx, s.Pool, s.Names(), migrate.Outbox, migrate.Inbox)
		}()
	}
	wg.Wait()
	total := 0
	for i := range 4 {
		if errs[i] != nil {
			t.Fatalf("concurrent migrate %d: %v", i, errs[i])
		}
		total += counts[i]
	}
	var files int
	if err := s.Pool.QueryRow(ctx, "SELECT count(*) FROM km0_migracions").Scan(&files); err != nil {
		t.Fatal(err)
	}
	if total != files || files != 6 {
		t.Fatalf("applied %d in all, %d recorded; want 6 and 6", total, files)
	}
	n, err := migrate.Up(ctx, s.Pool, s.Names(), migrate.Outbox, migrate.Inbox)
	if err != nil || n != 0 {
		t.Fatalf("second run applied %d (%v), want 0", n, err)
	}
}

func TestTablesMatchTheContract(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	want := map[string]string{
		"outbox":               "id uuid NO,agregat text NO,agregat_id text NO,tipus text NO,versio integer NO,carrega jsonb NO,creat_en timestamp with time zone NO,publicat_en timestamp with time zone YES,capcaleres jsonb YES",
		"missatges_processats": "id_missatge text NO,consumidor text NO,processat_en timestamp with time zone NO",
	}
	for table, cols := range want {
		var got string
		err := s.Pool.QueryRow(ctx, `SELECT string_agg(column_name || ' ' || data_type || ' ' || is_nullable, ',' ORDER BY ordinal_position)
			FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2`, s.Name, table).Scan(&got)
		if err != nil {
			t.Fatal(err)
		}
		if got != cols {
			t.Fatalf("%s columns:\n got %s\nwant %s", table, got, cols)
		}
	}
	var idx string
	if err := s.Pool.QueryRow(ctx, `SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'outbox_pendents'`, s.Name).Scan(&idx); err != nil {
		t.Fatalf("outbox_pendents index: %v", err)
	}
	if want := "WHERE (publicat_en IS NULL)"; !strings.Contains(idx, want) {
		t.Fatalf("outbox_pendents is %q, want a partial index %s", idx, want)
	}
}

func TestConfiguredNamesAreQuoted(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	names := migrate.Names{Schema: s.Name, Outbox: `sortida "rara"`, Processats: "Processats; DROP TABLE x"}
	if _, err := migrate.Up(context.Background(), s.Pool, names, migrate.Outbox, migrate.Inbox); err != nil {
		t.Fatalf("migrate with odd names: %v", err)
	}
	var n int
	if err := s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name IN ('sortida "rara"', 'Processats; DROP TABLE x')`, s.Name).Scan(&n); err != nil || n != 2 {
		t.Fatalf("odd table names: %d (%v)", n, err)
	}
}

// Two outbox tables (and two inbox tables) in one schema: migrating the
// second name creates the second set of tables, triggers and parking table,
// instead of finding the first name's files recorded and skipping them.
func TestSecondTableNameInOneSchemaIsMigrated(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	first := migrate.Names{Schema: s.Name}
	second := migrate.Names{Schema: s.Name, Outbox: "outbox_pagaments", Processats: "processats_b"}
	if _, err := migrate.Up(ctx, s.Pool, first, migrate.Outbox, migrate.Inbox); err != nil {
		t.Fatal(err)
	}
	n, err := migrate.Up(ctx, s.Pool, second, migrate.Outbox, migrate.Inbox)
	if err != nil {
		t.Fatal(err)
	}
	var tables, triggers int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1
		AND table_name IN ('outbox', 'outbox_aparcats', 'outbox_wal_aparcats', 'missatges_processats',
		'outbox_pagaments', 'outbox_pagaments_aparcats', 'outbox_pagaments_wal_aparcats', 'processats_b')`,
		s.Name).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass($1)`,
		second.Table("outbox_pagaments")).Scan(&triggers); err != nil {
		t.Fatal(err)
	}
	if n != 6 || tables != 8 || triggers != 2 {
		t.Fatalf("second names: applied %d files, %d of 8 tables, %d of 2 triggers on outbox_pagaments", n, tables, triggers)
	}
	if n, err := migrate.Up(ctx, s.Pool, second, migrate.Outbox, migrate.Inbox); err != nil || n != 0 {
		t.Fatalf("second names again: applied %d (%v), want 0", n, err)
	}
	if n, err := migrate.Up(ctx, s.Pool, first, migrate.Outbox, migrate.Inbox); err != nil || n != 0 {
		t.Fatalf("first names again: applied %d (%v), want 0", n, err)
	}
}

// A name PostgreSQL would truncate is refused before anything is created:
// two long outbox names with one 46-byte prefix would otherwise share
// "<prefix>_aparcats_agregat" cut to 63 bytes.
func TestNamesPostgreSQLWouldTruncateAreRefused(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	long := strings.Repeat("o", 47) // + "_aparcats_agregat" = 64 bytes
	for _, names := range []migrate.Names{
		{Schema: s.Name, Outbox: long},
		{Schema: s.Name, Processats: strings.Repeat("p", 53)},
		{Schema: s.Name, Outbox: "a\x00b"},
	} {
		_, err := migrate.Up(context.Background(), s.Pool, names, migrate.Outbox, migrate.Inbox)
		if err == nil || !strings.Contains(err.Error(), "migrate: ") {
			t.Errorf("%+v: got %v, want a refusal", names, err)
		}
	}
	var n int
	if err := s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1`, s.Name).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d tables created (%v), want 0", n, err)
	}
	if _, err := migrate.Up(context.Background(), s.Pool, migrate.Names{Schema: s.Name, Outbox: long[:46]}, migrate.Outbox); err != nil {
		t.Fatalf("a 46-byte outbox name (63 with its suffix): %v", err)
	}
}
