package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// `km0 outbox prune` refuses a missing or non-positive --older-than, a bad
// --batch and stray arguments before touching the database, and on a
// migrated outbox deletes only the published rows past the retention.
func TestOutboxPruneCommand(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	base := []string{"prune", "--database-url", pgtest.URL(), "--schema", s.Name}
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--older-than"}, {[]string{"--older-than", "0s"}, "--older-than"},
		{[]string{"--older-than", "-1h"}, "--older-than"},
		{[]string{"--older-than", "1h", "--batch", "0"}, "--batch"},
		{[]string{"--older-than", "1h", "--batch", "100001"}, "--batch"},
		{[]string{"--older-than", "1h", "--outbox-table", "no_such"}, "does not exist"},
	} {
		err := runOutbox(ctx, append(append([]string{}, base...), c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("km0 outbox prune %v: want an error naming %s, got %v", c.args, c.want, err)
		}
	}
	if err := runOutbox(ctx, append(append([]string{}, base...), "--older-than", "1h", "extra")); !errors.Is(err, cli.ErrUsage) {
		t.Errorf("km0 outbox prune with an argument: %v, want the usage error", err)
	}
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox (id, agregat, agregat_id, tipus, carrega)
		SELECT gen_random_uuid(), 'comanda', 'P-' || g, 'comanda.creada', '{}' FROM generate_series(1, 30) g`); err != nil {
		t.Fatal(err)
	}
	// 20 published two hours ago, 10 pending.
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox SET publicat_en = now() - interval '2 hours'
		WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 20)`); err != nil {
		t.Fatal(err)
	}
	if err := runOutbox(ctx, append(append([]string{}, base...), "--older-than", "1h", "--batch", "7")); err != nil {
		t.Fatal(err)
	}
	var left, pending int
	if err := s.Pool.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE publicat_en IS NULL) FROM outbox").Scan(&left, &pending); err != nil {
		t.Fatal(err)
	}
	if left != 10 || pending != 10 {
		t.Errorf("after prune: %d rows left, %d pending; want the 10 pending ones", left, pending)
	}
}

// `km0 relay --prune-older-than 1h` prunes at start: rows published two
// hours ago go, the pending ones are published and stay (marked just now).
func TestRelayCommandPrunesWithPruneOlderThan(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	b := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{"comandes.esdeveniments"}})
	ctx := context.Background()
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox (id, agregat, agregat_id, tipus, carrega)
		SELECT gen_random_uuid(), 'comanda', 'P-' || g, 'comanda.creada', '{}' FROM generate_series(1, 50) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox SET publicat_en = now() - interval '2 hours'
		WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 40)`); err != nil {
		t.Fatal(err)
	}
	stop := startRelay(t, "--schema", s.Name, "--brokers", strings.Join(b.Addrs(), ","),
		"--topic", "comandes.esdeveniments", "--origin", "comandes", "--poll", "20ms", "--prune-older-than", "1h")
	var rows, pending int
	testkit.Eventuallyf(t, 30*time.Second, "the 10 rows published now left, none pending", func() (bool, string) {
		_ = s.Pool.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE publicat_en IS NULL) FROM outbox").Scan(&rows, &pending)
		return rows == 10 && pending == 0, fmt.Sprintf("%d rows left, %d pending", rows, pending)
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if recs := kafkatest.ReadAll(t, b, "comandes.esdeveniments", 10, 10*time.Second); len(recs) != 10 {
		t.Fatalf("%d records on the topic, want 10", len(recs))
	}
}
