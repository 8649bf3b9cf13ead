package svc_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/tlstest"
)

// A password may sit in the user info, in a query parameter (libpq and pgx
// read ?password=) or in a keyword/value DSN: none may reach an error or the
// demo's progress line.
func TestRedactHidesEveryFormOfPassword(t *testing.T) {
	t.Parallel()
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

// A km0_<service> database derived from a base connection string keeps its
// host, user and TLS parameters, in the URL form and in the keyword/value
// form (which used to lose everything but the database).
func TestWithDatabaseKeepsTheTLSParameters(t *testing.T) {
	t.Parallel()
	ca := tlstest.NewCA(t, "km0 test CA")
	cl := ca.Client(t, "anna")
	tlsParams := "sslmode=verify-full&sslrootcert=" + ca.CertFile + "&sslcert=" + cl.CertFile + "&sslkey=" + cl.KeyFile
	for _, base := range []string{
		"postgres://anna@db.example:6432/postgres?" + tlsParams,
		"host=db.example port=6432 user=anna dbname=postgres " + strings.ReplaceAll(tlsParams, "&", " "),
	} {
		u, err := svc.WithDatabase(base, "km0_comandes")
		if err != nil {
			t.Fatalf("WithDatabase(%q): %v", base, err)
		}
		c, err := pgconn.ParseConfig(u)
		if err != nil {
			t.Fatalf("WithDatabase(%q) = %q does not parse: %v", base, u, err)
		}
		if c.Database != "km0_comandes" || c.Host != "db.example" || c.Port != 6432 || c.User != "anna" {
			t.Errorf("WithDatabase(%q) = %q: database %q host %q port %d user %q", base, u, c.Database, c.Host, c.Port, c.User)
		}
		if c.TLSConfig == nil || c.TLSConfig.InsecureSkipVerify || c.TLSConfig.RootCAs == nil || len(c.TLSConfig.Certificates) != 1 || len(c.Fallbacks) != 0 {
			t.Errorf("WithDatabase(%q) = %q: TLS %+v, %d fallbacks; want verify-full with the CA and the client certificate only", base, u, c.TLSConfig, len(c.Fallbacks))
		}
	}
	if _, err := svc.WithDatabase("", "km0_x"); err == nil {
		t.Error("WithDatabase of an empty base: want an error")
	}
}
