// Package testkit holds the two helpers km0's tests share: Eventually, the
// wait on a condition (never on time), and Start/Background, the runner of
// a component's Run for the length of a test. It imports nothing of km0, so
// every test and test kit may use it.
package testkit

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Poll is how often Eventually checks its condition.
const Poll = 10 * time.Millisecond

// StopTimeout is how long a Runner's Stop waits for its function to return
// after cancelling it.
const StopTimeout = time.Minute

// Eventually polls cond every Poll until it holds, or fails the test naming
// what after timeout. It is how tests wait for asynchronous work: the
// timeout is a bound on a hang, never the expected duration, so a loaded
// machine makes a test slower, not red.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	Eventuallyf(t, timeout, what, func() (bool, string) { return cond(), "" })
}

// Eventuallyf is Eventually with a condition that also describes the state
// it saw; the failure names what and the last state.
func Eventuallyf(t testing.TB, timeout time.Duration, what string, cond func() (ok bool, state string)) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(Poll)
	defer tick.Stop()
	for {
		ok, state := cond()
		if ok {
			return
		}
		select {
		case <-deadline.C:
			if state != "" {
				t.Fatalf("timed out after %v waiting for %s (%s)", timeout, what, state)
			}
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		case <-tick.C:
		}
	}
}

// A Runner is a function running in its own goroutine for a test (Start).
type Runner struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    error // run's result, set before done is closed
	once   sync.Once
	called atomic.Bool // Stop was called (by the test or by cleanup)
	stop   error       // Stop's result
}

// Start runs run in a goroutine, with a context that Stop cancels, and
// returns its Runner. If the test has not called Stop by its end, cleanup
// does, and fails the test when run returned an error (a crash the test did
// not ask for). A test that expects an error calls Stop and checks it.
func Start(t testing.TB, name string, run func(ctx context.Context) error) *Runner {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &Runner{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.err = run(ctx)
	}()
	t.Cleanup(func() {
		byTest := r.called.Load()
		if err := r.Stop(); err != nil && !byTest {
			t.Errorf("%s: %v", name, err)
		}
	})
	return r
}

// Background runs run (a component's Run) until the test ends, then cancels
// it and fails the test if it returned an error.
func Background(t testing.TB, name string, run func(ctx context.Context) error) {
	t.Helper()
	Start(t, name, run)
}

// Stop cancels the function's context, waits for it to return (at most
// StopTimeout) and returns its error. Later calls return the same error.
func (r *Runner) Stop() error {
	r.called.Store(true)
	r.once.Do(func() {
		r.cancel()
		select {
		case <-r.done:
			r.stop = r.err
		case <-time.After(StopTimeout):
			r.stop = fmt.Errorf("did not stop within %v of its cancellation", StopTimeout)
		}
	})
	return r.stop
}

// Done is closed when the function returned, by itself or after Stop.
func (r *Runner) Done() <-chan struct{} { return r.done }

// Err is what the function returned; call it once Done is closed.
func (r *Runner) Err() error { return r.err }
