// Package redact hides secrets in connection strings before they reach a
// log or an error, in one way for PostgreSQL and AMQP URLs.
package redact

import (
	"fmt"
	"net/url"

	"github.com/jackc/pgx/v5/pgconn"
)

// URL hides the password of a connection string: in the user info or a
// password/sslpassword query parameter of a URL (postgres://, amqp://,
// amqps://); a PostgreSQL keyword/value DSN is shown as
// postgres://user@host:port/database only. Anything else is
// "<unparseable URL>".
func URL(u string) string {
	pu, err := url.Parse(u)
	if err != nil || pu.Scheme == "" {
		if c, err := pgconn.ParseConfig(u); err == nil {
			return fmt.Sprintf("postgres://%s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
		}
		return "<unparseable URL>"
	}
	q := pu.Query()
	for _, k := range []string{"password", "sslpassword"} {
		if q.Has(k) {
			q.Set(k, "xxxxx")
			pu.RawQuery = q.Encode()
		}
	}
	return pu.Redacted()
}
