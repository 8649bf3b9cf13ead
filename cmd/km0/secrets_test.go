package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/lag"
)

// password is what these tests put in credentials: no output may show it.
const password = "S3cr3t-pw-91"

// writeFile writes content to a file of t's temporary directory.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// parseSecret registers a cli.SecretString flag "database-url" with def on a
// fresh flag set and parses args: the value, the cli.Parse error, and what the
// flag set printed.
func parseSecret(def string, args ...string) (v, printed string, err error) {
	fs := cli.NewFlags("x", "test")
	var out bytes.Buffer
	fs.SetOutput(&out)
	p := cli.SecretString(fs, "database-url", def, "PostgreSQL URL")
	err = cli.Parse(fs, args)
	return *p, out.String(), err
}

// A credential flag has three forms: the environment (def), --NAME and
// --NAME-file; either flag replaces the environment, both at once are
// refused, and no error quotes the credential.
func TestSecretStringForms(t *testing.T) {
	t.Parallel()
	env, cmdline, file := "postgres://u:"+password+"@env/db", "postgres://u:"+password+"@cli/db", "postgres://u:"+password+"@file/db"
	path := writeFile(t, "db-url", "\n  "+file+"\n")
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, env},
		{[]string{"--database-url", cmdline}, cmdline},
		{[]string{"--database-url-file", path}, file},
		{[]string{"--database-url-file", path, "--database-url-file", path}, file},
	} {
		if v, out, err := parseSecret(env, c.args...); err != nil || v != c.want {
			t.Errorf("%v: %q %v %s, want %q", c.args, v, err, out, c.want)
		}
	}
	for _, c := range []struct {
		args []string
		want string // in the printed error
	}{
		{[]string{"--database-url", cmdline, "--database-url-file", path}, "give --database-url or --database-url-file, not both"},
		{[]string{"--database-url-file", path, "--database-url", cmdline}, "give --database-url or --database-url-file, not both"},
		{[]string{"--database-url-file", writeFile(t, "empty", " \n")}, "is empty"},
		{[]string{"--database-url-file", writeFile(t, "two", file+"\nsecond-line-"+password+"\n")}, "more than one line"},
		{[]string{"--database-url-file", filepath.Join(t.TempDir(), "absent")}, "no such file"},
		{[]string{"--database-url-file", writeFile(t, "big", strings.Repeat("x", cli.SecretFileMax+1))}, "larger than 64 KiB"},
	} {
		_, out, err := parseSecret(env, c.args...)
		if !errors.Is(err, cli.ErrUsage) || !strings.Contains(out, c.want) || strings.Contains(out, password) {
			t.Errorf("%v: %v, printed %q; want a usage error saying %q, without the password", c.args, err, out, c.want)
		}
	}
	// --help names the file form and the ps warning, and never the value.
	fs := cli.NewFlags("x", "test")
	var help bytes.Buffer
	fs.SetOutput(&help)
	cli.SecretString(fs, "database-url", env, "PostgreSQL URL")
	if err := cli.Parse(fs, []string{"--help"}); !errors.Is(err, flag.ErrHelp) || strings.Contains(help.String(), password) ||
		!strings.Contains(help.String(), "-database-url-file") || !strings.Contains(help.String(), "shows in ps") {
		t.Errorf("--help: %v\n%s", err, help.String())
	}
}

// parseOutboxes parses args with the lag flags: the outboxes by name, the
// cli.Parse error and what was printed.
func parseOutboxes(args ...string) (vals map[string]string, keys []string, printed string, err error) {
	fs := cli.NewFlags("x", "test")
	var out bytes.Buffer
	fs.SetOutput(&out)
	lf := addLagFlags(fs, false)
	err = cli.Parse(fs, args)
	return lf.outboxes.vals, lf.outboxes.keys, out.String(), err
}

// --outbox NAME=DATABASE_URL has an environment form ($KM0_OUTBOXES,
// newline or ; separated) and a file form (--outbox-file, a line each);
// the command line replaces the environment, and a malformed entry is
// refused without being quoted.
//
// Not parallel: t.Setenv, for the environment the lag flags ($KM0_OUTBOXES)
// reads in this process.
func TestOutboxForms(t *testing.T) {
	u := func(db string) string { return "postgres://u:" + password + "@h/" + db }
	t.Setenv(outboxesEnv, "comandes="+u("c")+"; inventari = "+u("i")+"\n\npagaments="+u("p")+"\n")
	vals, keys, out, err := parseOutboxes()
	if err != nil || !slices.Equal(keys, []string{"comandes", "inventari", "pagaments"}) || vals["inventari"] != u("i") {
		t.Fatalf("$%s: %v %v %s", outboxesEnv, keys, err, out)
	}
	file := writeFile(t, "outboxes", "# the outboxes\ncataleg="+u("k")+"\n\n  repartiment="+u("r")+"  \n")
	vals, keys, out, err = parseOutboxes("--outbox", "comandes="+u("c2"), "--outbox-file", file)
	if err != nil || !slices.Equal(keys, []string{"comandes", "cataleg", "repartiment"}) || vals["comandes"] != u("c2") || vals["repartiment"] != u("r") {
		t.Fatalf("--outbox and --outbox-file replace $%s: %v %v %s", outboxesEnv, keys, err, out)
	}
	for _, c := range []struct {
		env  string
		args []string
		want string
	}{
		{"", []string{"--outbox", u("c")}, "--outbox: want NAME=VALUE (the value is not shown"},
		{"", []string{"--outbox", "c=" + u("c"), "--outbox", "c=" + u("d")}, "--outbox: c given twice"},
		{"", []string{"--outbox-file", writeFile(t, "bad", "a="+u("a")+"\n"+u("b")+"\n")}, "line 2: want NAME=VALUE"},
		{"a=" + u("a") + ";" + u("b"), nil, "$" + outboxesEnv + " entry 2: want NAME=VALUE"},
	} {
		t.Setenv(outboxesEnv, c.env)
		_, _, out, err := parseOutboxes(c.args...)
		if !errors.Is(err, cli.ErrUsage) || !strings.Contains(out, c.want) || strings.Contains(out, password) {
			t.Errorf("$%s=%q %v: %v, printed %q; want a usage error saying %q, without the password", outboxesEnv, c.env, c.args, err, out, c.want)
		}
	}
	// A malformed environment entry does not matter once the command line names the outboxes.
	t.Setenv(outboxesEnv, "garbage")
	if _, keys, out, err := parseOutboxes("--outbox", "a="+u("a")); err != nil || !slices.Equal(keys, []string{"a"}) {
		t.Fatalf("--outbox over a bad $%s: %v %v %s", outboxesEnv, keys, err, out)
	}
}

// withPassword returns u with the user's password set (the local server's
// trust authentication accepts any).
func withPassword(t *testing.T, u string) string {
	t.Helper()
	pu, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	pu.User = url.UserPassword(pu.User.Username(), password)
	return pu.String()
}

// km0 lag measures outboxes named in $KM0_OUTBOXES and in --outbox-file,
// and neither its output nor its logs show their password, also when a
// database does not answer.
//
// Not parallel: t.Setenv, for the environment km0 lag ($KM0_OUTBOXES) reads
// in this process; and captureStderr swaps os.Stdout and os.Stderr of the
// whole test binary.
func TestLagCommandOutboxesFromTheEnvironmentAndAFile(t *testing.T) {
	brokers, s := lagFixture(t)
	dbURL := withPassword(t, s.URL)
	run := func(args ...string) (*lag.Snapshot, string, error) {
		var out, errOut bytes.Buffer
		var err error
		logs := captureStderr(t, func() {
			err = lagCmd(context.Background(), &out, &errOut, append([]string{"--brokers", brokers, "--outbox-schema", s.Name, "--json"}, args...))
		})
		all := out.String() + errOut.String() + logs
		if strings.Contains(all, password) {
			t.Fatalf("km0 lag %v shows the password:\n%s", args, all)
		}
		var snap lag.Snapshot
		if err == nil {
			if jerr := json.Unmarshal(out.Bytes(), &snap); jerr != nil {
				t.Fatalf("km0 lag %v: %v\n%s", args, jerr, all)
			}
		}
		return &snap, all, err
	}
	t.Setenv(outboxesEnv, "comandes="+dbURL)
	snap, all, err := run()
	if err != nil || len(snap.Outboxes) != 1 || snap.Outboxes[0].Name != "comandes" || snap.Outboxes[0].Pending != 2 {
		t.Fatalf("km0 lag with $%s: %v %+v\n%s", outboxesEnv, err, snap.Outboxes, all)
	}
	t.Setenv(outboxesEnv, "")
	snap, all, err = run("--outbox-file", writeFile(t, "outboxes", "# km0 lag\nfitxer="+dbURL+"\n"))
	if err != nil || len(snap.Outboxes) != 1 || snap.Outboxes[0].Name != "fitxer" || snap.Outboxes[0].Pending != 2 {
		t.Fatalf("km0 lag --outbox-file: %v %+v\n%s", err, snap.Outboxes, all)
	}
	// A database that does not answer: an error naming the outbox (a part
	// not measured, exit 1), without the password.
	t.Setenv(outboxesEnv, "mort=postgres://u:"+password+"@127.0.0.1:1/km0?connect_timeout=2")
	if _, all, err := run(); err == nil || !strings.Contains(err.Error(), "outbox mort") || strings.Contains(err.Error(), password) || strings.Contains(all, password) {
		t.Fatalf("km0 lag with a dead outbox: %v\n%s", err, all)
	}
}

// km0 migrate works with its database URL in --database-url-file, and says
// nothing of the password.
//
// Not parallel: captureStderr swaps os.Stdout and os.Stderr of the whole test
// binary.
func TestMigrateDatabaseURLFromAFile(t *testing.T) {
	s := pgtest.NewSchema(t)
	path := writeFile(t, "db-url", withPassword(t, pgtest.URL())+"\n")
	var err error
	out := captureStderr(t, func() {
		err = commands["migrate"].run(context.Background(), []string{"--database-url-file", path, "--schema", s.Name})
	})
	if err != nil || !strings.Contains(out, "applied to schema "+s.Name) || strings.Contains(out, password) {
		t.Fatalf("km0 migrate --database-url-file: %v\n%s", err, out)
	}
	var n int
	if err := s.Pool.QueryRow(context.Background(), "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'outbox'", s.Name).Scan(&n); err != nil || n != 1 {
		t.Fatalf("outbox table in %s: %d %v", s.Name, n, err)
	}
}

// km0 dlq's --amqp-url-file selects RabbitMQ as --amqp-url does (and so
// asks for --queue); $KM0_AMQP_URL alone does not.
func TestDLQAMQPURLFileSelectsRabbitMQ(t *testing.T) {
	t.Parallel()
	path := writeFile(t, "amqp-url", "amqp://u:"+password+"@127.0.0.1:5672/\n")
	var out, errOut bytes.Buffer
	c := &dlqcli.CLI{Out: &out, ErrOut: &errOut, In: strings.NewReader(""), Now: time.Now}
	err := c.Run(context.Background(), []string{"ls", "--amqp-url-file", path, "--database-url", "postgres://x"})
	if err == nil || !strings.Contains(err.Error(), "--queue") || strings.Contains(err.Error()+out.String()+errOut.String(), password) {
		t.Fatalf("--amqp-url-file without --queue: %v\n%s%s", err, out.String(), errOut.String())
	}
}
