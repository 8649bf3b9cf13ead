package main

import (
	"context"
	"strings"
	"testing"

	"github.com/km0/km0/internal/pgtest"
)

// A relay started on an outbox migrated before the capcaleres column existed
// refuses to start with the fix, instead of failing every claim.
func TestRequireOutboxNamesTheMissingCapcaleresColumn(t *testing.T) {
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	if err := requireOutbox(ctx, s.Pool, s.Names(), false); err != nil {
		t.Fatalf("migrated outbox: %v", err)
	}
	if _, err := s.Pool.Exec(ctx, "ALTER TABLE outbox DROP COLUMN capcaleres"); err != nil {
		t.Fatal(err)
	}
	err := requireOutbox(ctx, s.Pool, s.Names(), false)
	if err == nil || !strings.Contains(err.Error(), "has no capcaleres column: run km0 migrate --schema "+s.Name) {
		t.Fatalf("outbox without capcaleres: %v", err)
	}
}
