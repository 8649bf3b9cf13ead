package cdc_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport/kafka"
)

// The test binary runs as a CDC relay process when childEnv is set (see
// TestMain): KM0_CDC_TEST_URL, KM0_CDC_TEST_SCHEMA, KM0_CDC_TEST_BROKER and
// KM0_CDC_TEST_APP configure it; KM0_CDC_TEST_WAL makes it a WAL-mode relay.
const childEnv = "KM0_CDC_TEST_CHILD"

func runChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_CDC_TEST_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	defer pool.Close()
	cl, err := kafka.NewClient([]string{os.Getenv("KM0_CDC_TEST_BROKER")})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	defer cl.Close()
	r, err := cdc.New(cdc.Config{Config: relay.Config{Pool: pool, Names: migrate.Names{Schema: os.Getenv("KM0_CDC_TEST_SCHEMA")},
		Publisher: kafka.NewPublisher(cl), Topic: topic, Origin: "comandes", ApplicationName: os.Getenv("KM0_CDC_TEST_APP"),
		BackoffMin: 10 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: testLogger()},
		StatusInterval: 100 * time.Millisecond, WAL: os.Getenv("KM0_CDC_TEST_WAL") != ""})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	if err := r.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	return 0
}

// startChild starts a relay process named app; cleanup kills it. env is
// added to its environment.
func (b *bundle) startChild(t *testing.T, app string, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"=1", "KM0_CDC_TEST_URL="+b.s.URL, "KM0_CDC_TEST_SCHEMA="+b.s.Name,
		"KM0_CDC_TEST_BROKER="+b.b.Addrs()[0], "KM0_CDC_TEST_APP="+app)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

// holder is the application_name of the session streaming from the slot, or "".
func (b *bundle) holder(t testing.TB) string {
	t.Helper()
	var app string
	err := b.s.Pool.QueryRow(context.Background(), `SELECT coalesce((SELECT a.application_name FROM pg_replication_slots s
		JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1), '')`, b.slot()).Scan(&app)
	if err != nil {
		t.Fatal(err)
	}
	return app
}

// One active instance, proven with processes: two relay processes of the
// same outbox, one streams and the other waits; writers write throughout;
// the active one is killed with SIGKILL (no cleanup of any kind) and the
// other takes the slot over within 5 s. Every event reaches the topic, in
// commit order per aggregate.
func TestStandbyProcessTakesOverWithin5sOfASIGKILL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 100)
	appA, appB := "km0-cdc-a-"+b.s.Name, "km0-cdc-b-"+b.s.Name
	a := b.startChild(t, appA)
	testkit.Eventually(t, 20*time.Second, "process A to hold the slot", func() bool { return b.holder(t) == appA })
	b.startChild(t, appB)
	testkit.Eventually(t, 20*time.Second, "process B to wait for the outbox's relay lock", func() bool {
		return b.count(t, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = $1`, appB) == 1
	})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, 2, 150, 21) }()
	testkit.Eventually(t, 20*time.Second, "A to publish some rows", func() bool {
		return b.count(t, "SELECT count(*) FROM outbox WHERE publicat_en IS NOT NULL") > 20
	})

	if err := a.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	_ = a.Wait()
	testkit.Eventually(t, 5*time.Second, "process B to take the slot over", func() bool { return b.holder(t) == appB })
	took := time.Since(killed)
	t.Logf("takeover %v after the SIGKILL", took.Round(time.Millisecond))
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "every row published", func() bool { return b.pending(t) == 0 })
	want := w.Counts(t)
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, relaytest.Total(want)))
	if len(copies) != relaytest.Total(want) {
		t.Fatalf("%d distinct events, want %d", len(copies), relaytest.Total(want))
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	if strings.TrimSpace(b.holder(t)) != appB {
		t.Fatalf("slot held by %q, want %q", b.holder(t), appB)
	}
}
