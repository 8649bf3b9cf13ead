package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/bench"
	"github.com/km0/km0/internal/cli"
)

// Not parallel: t.Setenv, for the environment the flag set
// ($KM0_DATABASE_URL) reads in this process.
func TestHelpNeverPrintsTheDatabaseURL(t *testing.T) {
	t.Setenv("KM0_DATABASE_URL", "postgres://km0:s3cret@db/km0")
	fs := cli.NewFlags("x", "test")
	var out bytes.Buffer
	fs.SetOutput(&out)
	v := cli.DatabaseURLFlag(fs)
	fs.Usage()
	if strings.Contains(out.String(), "s3cret") {
		t.Fatalf("--help leaks the password:\n%s", out.String())
	}
	if err := fs.Parse(nil); err != nil || *v != "postgres://km0:s3cret@db/km0" {
		t.Fatalf("environment fallback lost: %q %v", *v, err)
	}
}

// Every command's --help with secrets in the environment prints none of them.
//
// Not parallel: t.Setenv, for the environment every command's --help reads in
// this process; and captureStderr swaps os.Stdout and os.Stderr of the whole
// test binary.
func TestNoHelpPrintsASecretFromTheEnvironment(t *testing.T) {
	for _, v := range []string{"KM0_DATABASE_URL", "KM0_AMQP_URL", "KM0_DLQ_WEBHOOK", "KM0_PASSARELLA_URL", "KM0_DLQ_ADMIN_TOKEN", "KM0_CATALEG_DATABASE_URL", "KM0_AMQP_MANAGEMENT_URL"} {
		t.Setenv(v, "postgres://km0:s3cret@db/km0")
	}
	t.Setenv(outboxesEnv, "s3cret=postgres://km0:s3cret@db/km0")
	argvs := [][]string{}
	for name := range commands {
		argvs = append(argvs, []string{name, "--help"})
	}
	for _, sub := range []string{"ls", "show", "replay", "purge", "index"} {
		argvs = append(argvs, []string{"dlq", sub, "--help"})
	}
	for _, name := range bench.Names() {
		argvs = append(argvs, []string{"bench", name, "--help"})
	}
	argvs = append(argvs, []string{"outbox", "parked", "--help"}, []string{"outbox", "release", "--help"}, []string{"outbox", "prune", "--help"},
		[]string{"schema", "check", "--help"}, []string{"serve", "cataleg", "--help"})
	for _, argv := range argvs {
		out := captureStderr(t, func() { _ = commands[argv[0]].run(context.Background(), argv[1:]) })
		if strings.Contains(out, "s3cret") {
			t.Errorf("km0 %s leaks a secret:\n%s", strings.Join(argv, " "), out)
		}
	}
}

func captureStderr(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old, oldOut := os.Stderr, os.Stdout
	os.Stderr, os.Stdout = w, w
	done := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		done <- string(b)
	}()
	f()
	os.Stderr, os.Stdout = old, oldOut
	_ = w.Close()
	return <-done
}

// A malformed RabbitMQ URL is refused with an error that does not echo its
// password (url.Parse's error quotes the whole URL).
func TestMalformedAMQPURLErrorHidesThePassword(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"amqp://guest:s3cret@[bad/", "amqp://guest:s3cret@host:abc/", "amqp://guest:s3cret@127.0.0.1:5672/%zz"} {
		err := bench.Run(context.Background(), []string{"rpc", "--amqp-url", u, "--n", "1", "--kafka=false"})
		if err == nil {
			t.Fatalf("%s: no error", u)
		}
		if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("the error leaks the password: %v", err)
		}
	}
}

// `km0 X --help` succeeds (main exits 0) for every command, also those
// whose first argument is a subcommand or a name (schema, serve, outbox, dlq, bench).
//
// Not parallel: captureStderr swaps os.Stdout and os.Stderr of the whole test
// binary.
func TestEveryCommandHelpSucceeds(t *testing.T) {
	for name, c := range commands {
		var err error
		captureStderr(t, func() { err = c.run(context.Background(), []string{"--help"}) })
		if err != nil && !errors.Is(err, flag.ErrHelp) {
			t.Errorf("km0 %s --help: %v (exit code 2)", name, err)
		}
	}
}

// `km0 up --http` entries that are not NAME=ADDR for a known server are
// refused, not ignored (the service would listen on a random port instead).
// The context only bounds a hang.
func TestUpRefusesMalformedHTTPAddrs(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"comandes:8080", "comandez=:8080", "=:8080", "comandes="} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := runServices(ctx, "up", []string{"comandes"}, []string{"--database-url", "postgres://postgres@127.0.0.1:1/postgres",
			"--brokers", "127.0.0.1:1", "--http", v})
		cancel()
		if err == nil || !strings.Contains(err.Error(), "--http") {
			t.Errorf("--http %q: want an error naming --http, got %v", v, err)
		}
	}
}

// `km0 bench relay|latency` refuse a --batch or --workers the relay would not
// use as given (0 is the relay's adaptive default, reported as "adaptive").
//
// Not parallel: captureStderr swaps os.Stdout and os.Stderr of the whole test
// binary.
func TestBenchRefusesBatchAndWorkersOutOfRange(t *testing.T) {
	for _, c := range []struct {
		fn   func(context.Context, []string) error
		args []string
	}{
		{benchCmd("relay"), []string{"--n", "10", "--aggregates", "2", "--batch", "-1"}},
		{benchCmd("relay"), []string{"--n", "10", "--aggregates", "2", "--workers", "-1"}},
		{benchCmd("latency"), []string{"--rate", "10", "--seconds", "0.2", "--workers", "65"}},
	} {
		var err error
		captureStderr(t, func() { err = c.fn(context.Background(), c.args) })
		name := c.args[len(c.args)-2]
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%v: want an error naming %s, got %v", c.args, name, err)
		}
	}
}
