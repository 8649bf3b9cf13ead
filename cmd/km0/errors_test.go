package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/testkit"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
)

// A database that does not exist, a login the server refuses and a URL
// that does not parse are each named as such, by km0 migrate, relay and up
// as processes: one line, the cause first, no password, no pgx chain (no
// line per address and TLS mode tried).
func TestDatabaseErrorsNameTheCause(t *testing.T) {
	t.Parallel()
	base, err := url.Parse(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	host, port := base.Hostname(), base.Port()
	missing := *base
	missing.Path = "/km0_no_such_database"
	missing.User = url.User(base.User.Username())
	stranger := *base
	stranger.User = url.UserPassword("km0_no_such_role", password)
	const malformed = "postgres://anna:" + password + "@db.example:notaport/km0"
	user := base.User.Username()
	for _, c := range []struct{ url, want string }{
		{missing.String(), fmt.Sprintf(`database "km0_no_such_database" does not exist on the PostgreSQL server at %s:%s (create it, e.g. createdb -h %s -p %s -U %s km0_no_such_database, or name one that exists)`, host, port, host, port, user)},
		{stranger.String(), fmt.Sprintf(`the PostgreSQL server at %s:%s refused the login of user "km0_no_such_role" to database %q: role "km0_no_such_role" does not exist (check the password and the server's pg_hba.conf)`, host, port, strings.TrimPrefix(base.Path, "/"))},
		{malformed, "invalid --database-url postgres://anna:xxxxx@db.example:notaport/km0: want postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?sslmode=disable|require|verify-full]"},
	} {
		for _, argv := range [][]string{
			{"migrate"},
			{"relay", "--topic", "comandes.esdeveniments", "--origin", "comandes", "--brokers", "127.0.0.1:1"},
			{"up", "--embedded-kafka"},
		} {
			_, stderr, err := runKm0(t, []string{"KM0_DATABASE_URL=" + c.url}, argv...)
			want := "km0 " + argv[0] + ": " + c.want + "\n"
			if err == nil || stderr != want {
				t.Errorf("km0 %s with %s: exit %v, stderr\n%s\nwant\n%s", strings.Join(argv, " "), c.url, err, stderr, want)
			}
			if strings.Contains(stderr, password) {
				t.Errorf("km0 %s shows the password", argv[0])
			}
		}
	}
}

// A service's own database (KM0_<SERVICE>_DATABASE_URL) is used as is,
// never created: one that does not exist is named, with the service.
func TestServeNamesAMissingOwnDatabase(t *testing.T) {
	t.Parallel()
	base, err := url.Parse(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	missing := *base
	missing.Path = "/km0_no_such_database"
	_, stderr, err := runKm0(t, []string{"KM0_CATALEG_DATABASE_URL=" + missing.String()}, "serve", "cataleg", "--brokers", "127.0.0.1:1")
	want := fmt.Sprintf("km0 serve: cataleg: database \"km0_no_such_database\" does not exist on the PostgreSQL server at %s:%s (create it, e.g. createdb -h %s -p %s -U %s km0_no_such_database, or name one that exists)\n",
		base.Hostname(), base.Port(), base.Hostname(), base.Port(), base.User.Username())
	if err == nil || stderr != want {
		t.Errorf("km0 serve cataleg with a missing own database: %v, stderr\n%s\nwant\n%s", err, stderr, want)
	}
}

// A flag error prints the error and one line pointing to --help, exit 2,
// not the whole help (which --help still prints).
func TestFlagErrorPointsToHelp(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		argv []string
		want string
	}{
		{[]string{"up", "--bogus"}, "flag provided but not defined: -bogus\nrun km0 up --help for its flags\n"},
		{[]string{"relay", "--batch", "x"}, "invalid value \"x\" for flag -batch: parse error\nrun km0 relay --help for its flags\n"},
		{[]string{"serve", "cataleg", "--nope"}, "flag provided but not defined: -nope\nrun km0 serve cataleg --help for its flags\n"},
		{[]string{"dlq", "ls", "--bogus"}, "flag provided but not defined: -bogus\nrun km0 dlq ls --help for its flags\n"},
		{[]string{"outbox", "parked", "--bogus"}, "flag provided but not defined: -bogus\nrun km0 outbox parked --help for its flags\n"},
	} {
		_, stderr, err := runKm0(t, nil, c.argv...)
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || stderr != c.want {
			t.Errorf("km0 %s: %v, stderr\n%s\nwant exit 2 and\n%s", strings.Join(c.argv, " "), err, stderr, c.want)
		}
	}
	_, stderr, err := runKm0(t, nil, "up", "--help")
	if err != nil || !strings.Contains(stderr, "-database-url") {
		t.Errorf("km0 up --help: %v, stderr\n%s", err, stderr)
	}
}

// A Kafka that cannot be reached yet: km0 relay and km0 up behave alike,
// each logs a warning naming the brokers and retries, and runs once the
// broker is there (docs/operations.md, "A broker that cannot be reached").
func TestRelayAndUpWaitForKafkaWithAWarning(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t) // nothing listens there yet
	s := pgtest.NewMigratedSchema(t)
	suffix := fmt.Sprintf("wait_%d", os.Getpid())
	t.Cleanup(func() {
		for _, name := range system.Services {
			_ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName(name, suffix))
		}
	})
	relayP := startKm0(t, nil, "relay", "--database-url", s.URL, "--schema", s.Name, "--topic", "comandes.esdeveniments", "--origin", "comandes", "--brokers", addr)
	upP := startKm0(t, nil, "up", "--database-url", pgtest.URL(), "--database-suffix", suffix, "--brokers", addr)
	for _, w := range []struct {
		p    *proc
		want string
	}{
		{relayP, `msg="km0 relay: cannot create or check the topic; retrying" topic=comandes.esdeveniments`},
		{upP, `msg="km0 up: Kafka does not answer; retrying" brokers=` + addr + ` err=`},
	} {
		testkit.Eventually(t, time.Minute, "the warning "+w.want, func() bool {
			select {
			case <-w.p.exited:
				t.Fatalf("exited while Kafka was down: %v\n%s", w.p.err, w.p.log())
			default:
			}
			return strings.Contains(w.p.log(), w.want)
		})
	}
	stop := startKafkaCommand(t, addr)
	defer stop()
	upP.waitRunning(t, 90*time.Second)
	testkit.Eventually(t, time.Minute, "the relay running", func() bool { return strings.Contains(relayP.log(), `msg="km0 relay: running"`) })
}
