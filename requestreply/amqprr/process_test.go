package amqprr_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/transport/amqp"
)

// Environment of the server process that TestServerProcess runs.
const (
	envQueue = "KM0_RRTEST_SERVER_QUEUE"
	envLog   = "KM0_RRTEST_SERVER_LOG"
)

// TestServerProcess is not a test: it is the server process the SIGKILL
// proof starts (this test binary, re-executed). Each handler call appends
// the request id to the log file before anything else, so the parent sees
// every call, even of a process it killed. A request whose id starts with
// "tinguda" is held forever.
func TestServerProcess(t *testing.T) {
	t.Parallel()
	queue, logPath := os.Getenv(envQueue), os.Getenv(envLog)
	if queue == "" {
		t.Skip("the server process of TestSIGKILLedServerWithExpiredBacklog")
	}
	f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp.Dial(context.Background(), amqp.Config{URL: amqptest.URL(), Name: "km0-rrtest-server"})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := amqprr.NewServer(context.Background(), amqprr.ServerConfig{Conn: conn, Queue: queue,
		Handler: func(ctx context.Context, r *requestreply.Request) ([]byte, error) {
			if _, err := f.WriteString(r.ID + "\n"); err != nil {
				return nil, err
			}
			if strings.HasPrefix(r.ID, "tinguda") {
				<-ctx.Done()
			}
			return r.Body, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	_ = srv.Run(context.Background()) // until killed
}

// A server process SIGKILLed while it holds requests, restarted after a
// backlog of requests has expired: the requests it held and the backlog
// never reach a handler again, and fresh requests are answered within their
// timeout.
func TestSIGKILLedServerWithExpiredBacklog(t *testing.T) {
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.rr.proces")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue, contract.DLQName(queue)} })
	logPath := t.TempDir() + "/crides"
	start := func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^TestServerProcess$")
		cmd.Env = append(os.Environ(), envQueue+"="+queue, envLog+"="+logPath)
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	calls := func(prefix string) int {
		b, _ := os.ReadFile(logPath)
		n := 0
		for _, l := range strings.Split(string(b), "\n") {
			if l != "" && strings.HasPrefix(l, prefix) {
				n++
			}
		}
		return n
	}
	cl, err := amqprr.NewClient(context.Background(), amqprr.ClientConfig{Conn: conn})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	ask := func(id string, timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		resp, err := cl.Request(ctx, queue, id, []byte(`"`+id+`"`))
		if err == nil && string(resp) != `"`+id+`"` {
			err = fmt.Errorf("%s got %s", id, resp)
		}
		return err
	}

	first := start()
	// The queue exists once the server declared it; until then the
	// request is returned (ErrNoService).
	testkit.Eventually(t, 30*time.Second, "the first server process to answer", func() bool { return ask("inici", 2*time.Second) == nil })
	// Requests it holds (unacked) when it is killed.
	const held = 5
	var wg sync.WaitGroup
	for i := range held {
		wg.Add(1)
		go func() { defer wg.Done(); _ = ask(fmt.Sprintf("tinguda-%d", i), 300*time.Millisecond) }()
	}
	testkit.Eventually(t, 20*time.Second, "the held requests in the handler", func() bool { return calls("tinguda") == held })
	if err := first.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = first.Wait()
	wg.Wait()
	// A backlog while no server runs: every requester gives up.
	const backlog = 500
	var timedOut sync.WaitGroup
	var mu sync.Mutex
	late := 0
	for i := range backlog {
		timedOut.Add(1)
		go func() {
			defer timedOut.Done()
			if err := ask(fmt.Sprintf("vella-%d", i), 300*time.Millisecond); !errors.Is(err, requestreply.ErrTimeout) {
				mu.Lock()
				late++
				mu.Unlock()
			}
		}()
	}
	timedOut.Wait()
	if late != 0 {
		t.Fatalf("%d backlog requests did not time out", late)
	}

	start()
	errs := make(chan error, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The new process needs a moment to connect: ask until answered,
			// each attempt within its own 2 s.
			deadline := time.Now().Add(30 * time.Second)
			for {
				err := ask(fmt.Sprintf("nova-%d", i), 2*time.Second)
				if err == nil || time.Now().After(deadline) {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if n := calls("vella"); n != 0 {
		t.Fatalf("the handler ran for %d expired backlog requests, want 0", n)
	}
	if n := calls("tinguda"); n != held {
		t.Fatalf("the handler ran %d times for the %d requests the killed server held, want %d (none after the restart)", n, held, held)
	}
}
