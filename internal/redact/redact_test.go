package redact_test

import (
	"strings"
	"testing"

	"github.com/km0/km0/internal/redact"
)

// A password may sit in the user info, in a query parameter (libpq and pgx
// read ?password=) or in a keyword/value DSN, of a PostgreSQL or an AMQP
// URL: none may reach a log or an error.
func TestURLHidesEveryFormOfPassword(t *testing.T) {
	for _, u := range []string{
		"postgres://anna:hunter2@127.0.0.1:1/postgres",
		"postgres://anna@127.0.0.1:1/postgres?sslmode=disable&password=hunter2",
		"postgresql://127.0.0.1:1/postgres?sslpassword=hunter2",
		"host=127.0.0.1 port=1 user=anna password=hunter2 dbname=postgres",
		"amqp://guest:hunter2@127.0.0.1:5672/",
		"amqps://guest:hunter2@rabbit.example:5671/vh",
		"::hunter2",
	} {
		if r := redact.URL(u); strings.Contains(r, "hunter2") {
			t.Errorf("URL(%q) = %q", u, r)
		}
	}
	if got := redact.URL("amqp://guest@127.0.0.1:5672/"); got != "amqp://guest@127.0.0.1:5672/" {
		t.Errorf("a URL without a password changed: %q", got)
	}
}

// A connection string that does not parse is shown back in its error
// (the user must see what to fix), with its password hidden.
func TestMalformedHidesThePassword(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://anna:hunter2@db:notaport/x":                 "postgres://anna:xxxxx@db:notaport/x",
		"postgres://anna:hun@ter2@db:notaport/x":                "postgres://anna:xxxxx@db:notaport/x",
		"postgres://anna@db:notaport/x?password=hunter2&a=b":    "postgres://anna@db:notaport/x?password=xxxxx&a=b",
		"host=db port=x user=anna password='hun ter2' dbname=x": "host=db port=x user=anna password=xxxxx dbname=x",
		"postgres://db:notaport/x":                              "postgres://db:notaport/x",
	} {
		if got := redact.Malformed(in); got != want {
			t.Errorf("Malformed(%q) = %q, want %q", in, got, want)
		}
	}
}
