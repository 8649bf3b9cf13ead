package relay_test

import (
	"context"
	"strings"
	"testing"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/relay"
)

// A relay started on an outbox migrated before the capcaleres column existed
// refuses to start with the fix, instead of failing every claim; so does one
// on no outbox at all, and a WAL-mode relay without its parking table.
func TestCheckOutboxNamesTheMigrationToRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.NewMigratedSchema(t)
	if err := relay.CheckOutbox(ctx, s.Pool, s.Names(), false); err != nil {
		t.Fatalf("migrated outbox: %v", err)
	}
	if _, err := s.Pool.Exec(ctx, "ALTER TABLE outbox DROP COLUMN capcaleres"); err != nil {
		t.Fatal(err)
	}
	err := relay.CheckOutbox(ctx, s.Pool, s.Names(), false)
	if err == nil || !strings.Contains(err.Error(), "has no capcaleres column: run km0 migrate --schema "+s.Name) {
		t.Fatalf("outbox without capcaleres: %v", err)
	}
	empty := pgtest.NewSchema(t)
	err = relay.CheckOutbox(ctx, empty.Pool, empty.Names(), false)
	if err == nil || !strings.Contains(err.Error(), "outbox does not exist: run km0 migrate --schema "+empty.Name+" first") {
		t.Fatalf("no outbox: %v", err)
	}
	err = relay.CheckOutbox(ctx, empty.Pool, empty.Names(), true)
	if err == nil || !strings.Contains(err.Error(), "outbox_wal_aparcats does not exist") || !strings.Contains(err.Error(), "--outbox-mode wal") {
		t.Fatalf("WAL mode without its parking table: %v", err)
	}
}

// CheckSizes refuses what relay.New refuses of a fixed BatchSize or Workers,
// under the names the caller gives (a command's flags), and accepts 0, the
// adaptive default of both, and the bounds.
func TestCheckSizesNamesTheSetting(t *testing.T) {
	t.Parallel()
	for _, ok := range [][2]int{{0, 0}, {1, 1}, {relay.BatchSizeMax, relay.ShardCount}} {
		if err := relay.CheckSizes(ok[0], ok[1], "--batch", "--workers"); err != nil {
			t.Errorf("CheckSizes(%d, %d): %v", ok[0], ok[1], err)
		}
	}
	for _, c := range []struct {
		batch, workers int
		want           string
	}{
		{-1, 0, "--batch -1 is outside 0 (adaptive)..10000"},
		{relay.BatchSizeMax + 1, 0, "--batch 10001 is outside"},
		{0, -1, "--workers -1 is outside 0 (adaptive)..64"},
		{0, relay.ShardCount + 1, "--workers 65 is outside"},
	} {
		err := relay.CheckSizes(c.batch, c.workers, "--batch", "--workers")
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("CheckSizes(%d, %d): %v, want %q", c.batch, c.workers, err, c.want)
		}
	}
	if _, err := relay.New(relay.Config{Workers: relay.ShardCount + 1}); err == nil || !strings.Contains(err.Error(), "Workers 65 is outside") {
		t.Errorf("relay.New with 65 workers: %v, want the field named", err)
	}
}
