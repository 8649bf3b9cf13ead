package svc_test

import (
	"context"
	"strings"
	"testing"

	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/services/svc"
)

// A password may sit in the user info, in a query parameter (libpq and pgx
// read ?password=) or in a keyword/value DSN: none may reach an error or the
// demo's progress line.
func TestRedactHidesEveryFormOfPassword(t *testing.T) {
	for _, u := range []string{
		"postgres://anna:hunter2@127.0.0.1:1/postgres",
		"postgres://anna@127.0.0.1:1/postgres?sslmode=disable&password=hunter2",
		"postgresql://127.0.0.1:1/postgres?sslpassword=hunter2",
		"host=127.0.0.1 port=1 user=anna password=hunter2 dbname=postgres",
	} {
		if r := redact.URL(u); strings.Contains(r, "hunter2") {
			t.Errorf("Redact(%q) = %q", u, r)
		}
		_, err := svc.EnsureDatabase(context.Background(), u, "km0_x")
		if err == nil || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("EnsureDatabase(%q): %v", u, err)
		}
	}
}
