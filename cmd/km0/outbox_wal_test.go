package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/relay"
)

// `km0 outbox parked|release --outbox wal` read and release the WAL-mode
// parking table (<outbox>_wal_aparcats), in the state the CDC relay leaves
// it (relay/cdc's TestWALRefusedMessageIsParkedAndItsAggregateWaitsUntilReleased
// proves the relay's side): the refused heads listed with the messages kept
// behind each, one released by id, then the rest with --all, a second release
// refused as not parked; prune refuses the WAL mode; the table mode's
// listing points to the WAL one.
//
// Not parallel: captureStderr swaps os.Stdout and os.Stderr of the whole test
// binary.
func TestOutboxParkedAndReleaseCommandsInWALMode(t *testing.T) {
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	x2, x3, x4, y1 := uuid.New(), uuid.New(), uuid.New(), uuid.New()
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_wal_aparcats (id, lsn, agregat, agregat_id, tipus, versio, carrega, creat_en, motiu)
		VALUES ($1, '0/100', 'comanda', 'X', 'comanda.creada', 1, '{}', now(), 'broker: MESSAGE_TOO_LARGE'),
		       ($2, '0/200', 'comanda', 'X', 'comanda.pagada', 1, '{}', now(), NULL),
		       ($3, '0/300', 'comanda', 'X', 'comanda.enviada', 1, '{}', now(), NULL),
		       ($4, '0/250', 'comanda', 'Y', 'comanda.creada', 1, '{}', now(), 'broker: MESSAGE_TOO_LARGE')`,
		x2, x3, x4, y1); err != nil {
		t.Fatal(err)
	}
	base := func(sub string, more ...string) []string {
		return append([]string{sub, "--database-url", pgtest.URL(), "--schema", s.Name, "--outbox", "wal"}, more...)
	}
	var err error
	out := captureStderr(t, func() { err = runOutbox(ctx, base("parked")) })
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "ID ") ||
		!strings.Contains(lines[1], x2.String()) || !strings.Contains(lines[1], "comanda.creada") ||
		len(strings.Fields(lines[1])) < 7 || strings.Fields(lines[1])[5] != "2" ||
		!strings.Contains(lines[2], y1.String()) || strings.Fields(lines[2])[5] != "0" {
		t.Fatalf("km0 outbox parked --outbox wal: want X2 with 2 waiting and Y1 with 0, got:\n%s", out)
	}
	out = captureStderr(t, func() { err = runOutbox(ctx, []string{"parked", "--database-url", pgtest.URL(), "--schema", s.Name}) })
	if err != nil || !strings.Contains(out, "no parked rows") || !strings.Contains(out, "2 parked message(s)") || !strings.Contains(out, "--outbox wal") {
		t.Fatalf("km0 outbox parked (table mode) beside parked WAL messages: %v\n%s", err, out)
	}
	captureStderr(t, func() { err = runOutbox(ctx, base("release", x2.String())) })
	if err != nil {
		t.Fatal(err)
	}
	captureStderr(t, func() { err = runOutbox(ctx, base("release", x2.String())) })
	if !errors.Is(err, relay.ErrNotParked) {
		t.Fatalf("second release of %s: %v, want ErrNotParked", x2, err)
	}
	var heads, kept int
	count := func() {
		t.Helper()
		if err := s.Pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE motiu IS NOT NULL), count(*) FROM outbox_wal_aparcats").Scan(&heads, &kept); err != nil {
			t.Fatal(err)
		}
	}
	if count(); heads != 1 || kept != 4 {
		t.Fatalf("after releasing X2: %d parked, %d kept; want 1 (Y1) and 4 (the relay deletes them once published)", heads, kept)
	}
	out = captureStderr(t, func() { err = runOutbox(ctx, base("release", "--all")) })
	if err != nil || !strings.Contains(out, "released 1 parked message(s)") {
		t.Fatalf("release --all: %v\n%s", err, out)
	}
	if count(); heads != 0 || kept != 4 {
		t.Fatalf("after --all: %d parked, %d kept; want 0 and 4", heads, kept)
	}
	out = captureStderr(t, func() { err = runOutbox(ctx, base("parked")) })
	if err != nil || !strings.Contains(out, "no parked messages") {
		t.Fatalf("km0 outbox parked --outbox wal after --all: %v\n%s", err, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{base("prune", "--older-than", "1h"), "no rows to prune"},
		{[]string{"parked", "--database-url", pgtest.URL(), "--schema", s.Name, "--outbox", "rows"}, `--outbox "rows"`},
		{base("parked", "--outbox-table", "no_such"), "--outbox-mode wal"},
		{base("release", "not-a-uuid"), "not a message id"},
	} {
		captureStderr(t, func() { err = runOutbox(ctx, c.args) })
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("km0 outbox %v: want an error naming %q, got %v", c.args, c.want, err)
		}
	}
}
