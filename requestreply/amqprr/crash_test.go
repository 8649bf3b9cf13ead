package amqprr_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/transport/amqp"
)

// Environment of the process TestIdempotentServerProcess runs.
const (
	envCrashQueue  = "KM0_RRTEST_CRASH_QUEUE"
	envCrashDB     = "KM0_RRTEST_CRASH_DB"
	envCrashSchema = "KM0_RRTEST_CRASH_SCHEMA"
	envCrashAt     = "KM0_RRTEST_CRASH_AT" // "handler", "ack" or empty
)

// TestIdempotentServerProcess is not a test: it is the server process of
// TestSIGKILLAroundTheAckLosesNoStoredResponse (this test binary,
// re-executed), as the system runs it: an Idempotent handler on PostgreSQL
// and a connection with coalesced writes. Its effect writes a random token
// to efectes and answers it, so a second run of the effect would show as a
// second row and a different answer. With KM0_RRTEST_CRASH_AT it SIGKILLs
// itself at that point of the first request: right after the handler
// returned (committed, nothing sent), or right after the ack was issued
// (the reply and the ack at most queued in the connection).
func TestIdempotentServerProcess(t *testing.T) {
	t.Parallel()
	queue := os.Getenv(envCrashQueue)
	if queue == "" {
		t.Skip("the server process of TestSIGKILLAroundTheAckLosesNoStoredResponse")
	}
	pool := pgtest.NewPool(t, os.Getenv(envCrashDB), 4)
	names := migrate.Names{Schema: os.Getenv(envCrashSchema)}
	conn, err := amqp.Dial(context.Background(), amqp.Config{URL: amqptest.URL(), Name: "km0-rrtest-crash", CoalesceWrites: true})
	if err != nil {
		t.Fatal(err)
	}
	h := requestreply.Idempotent(pool, names, "t.crash", func(ctx context.Context, tx pgx.Tx, r *requestreply.Request) ([]byte, error) {
		b := make([]byte, 8)
		_, _ = rand.Read(b)
		token := `"` + hex.EncodeToString(b) + `"`
		_, err := tx.Exec(ctx, "INSERT INTO efectes (id_peticio, testimoni) VALUES ($1, $2)", r.ID, token)
		return []byte(token), err
	})
	srv, err := amqprr.NewServer(context.Background(), amqprr.ServerConfig{Conn: conn, Queue: queue, Handler: h})
	if err != nil {
		t.Fatal(err)
	}
	die := func() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL); select {} }
	switch os.Getenv(envCrashAt) {
	case "handler":
		amqprr.SetCrashHooks(srv, die, nil)
	case "ack":
		amqprr.SetCrashHooks(srv, nil, die)
	}
	_ = srv.Run(context.Background()) // until killed
}

// A server SIGKILLed right after its handler committed, or right after it
// acked the request, loses nothing: the requester, asking again with the
// same request id, gets the response stored by the first run, and the
// effect ran once. (Replies are not confirmed and the ack may still be in
// the connection's buffer when the process dies: what must be durable is in
// PostgreSQL before the ack is issued.)
func TestSIGKILLAroundTheAckLosesNoStoredResponse(t *testing.T) {
	t.Parallel()
	for _, at := range []string{"handler", "ack"} {
		t.Run(at, func(t *testing.T) { crashAround(t, at) })
	}
}

func crashAround(t *testing.T, at string) {
	conn := amqptest.Dial(t)
	db := pgtest.NewSchema(t)
	ctx := context.Background()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox, requestreply.Migrations); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE efectes (id_peticio text NOT NULL, testimoni text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	queue := amqptest.Name("t.rr.crash")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue, contract.DLQName(queue)} })
	start := func(crashAt string) *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^TestIdempotentServerProcess$")
		cmd.Env = append(os.Environ(), envCrashQueue+"="+queue, envCrashDB+"="+db.URL, envCrashSchema+"="+db.Name, envCrashAt+"="+crashAt)
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: conn})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	ask := func(timeout time.Duration) (string, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		b, err := cl.Request(ctx, queue, "peticio-1", []byte(`{}`))
		return string(b), err
	}

	first := start(at)
	// The first request (ErrNoService until the process declared the queue).
	var firstAnswer string
	deadline := time.Now().Add(30 * time.Second)
	for {
		a, err := ask(time.Second)
		if err == nil {
			firstAnswer = a // the reply left before the process died
			break
		}
		if errors.Is(err, requestreply.ErrTimeout) {
			break // the process died with the request
		}
		if !errors.Is(err, requestreply.ErrNoService) || time.Now().After(deadline) {
			t.Fatalf("first request: %v", err)
		}
	}
	_ = first.Wait()
	if ws, ok := first.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the first server did not die at the crash point: %v", first.ProcessState)
	}
	start("")
	var again string
	deadline = time.Now().Add(30 * time.Second)
	for {
		again, err = ask(2 * time.Second)
		if err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatalf("the request asked again: %v", err)
	}
	var effects int
	var stored string
	if err := db.Pool.QueryRow(ctx, "SELECT count(*), min(testimoni) FROM efectes").Scan(&effects, &stored); err != nil {
		t.Fatal(err)
	}
	if effects != 1 || again != stored || (firstAnswer != "" && firstAnswer != stored) {
		t.Fatalf("crash after the %s: %d effects (want 1), stored %s, answers %q then %q", at, effects, stored, firstAnswer, again)
	}
	t.Logf("crash after the %s: first answer %q, answer asked again %q, 1 effect", at, firstAnswer, again)
}
