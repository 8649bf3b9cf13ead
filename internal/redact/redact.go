// Package redact hides secrets in connection strings before they reach a
// log or an error, in one way for PostgreSQL and AMQP URLs.
package redact

import (
	"fmt"
	"net/url"
	"regexp"
	"strings"

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

// Malformed hides the password of a connection string that does not parse
// (so URL would only say "<unparseable URL>"), to show it back in an error:
// the text after the first ':' of the user info of SCHEME://USER:PASSWORD@…
// and the value of a password= or sslpassword= parameter or keyword become
// xxxxx. The rest is left as given, so the user sees what to fix.
func Malformed(u string) string {
	if i := strings.Index(u, "://"); i >= 0 {
		rest := u[i+3:]
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			if c := strings.Index(rest[:at], ":"); c >= 0 {
				rest = rest[:c+1] + "xxxxx" + rest[at:]
			}
		}
		u = u[:i+3] + rest
	}
	return passwordParam.ReplaceAllString(u, "${1}xxxxx")
}

// passwordParam is a password= or sslpassword= parameter (of a URL query)
// or keyword (of a keyword/value DSN), with its value.
var passwordParam = regexp.MustCompile(`(?i)((?:^|[?&\s])(?:ssl)?password\s*=\s*)('[^']*'|[^&\s]*)`)
