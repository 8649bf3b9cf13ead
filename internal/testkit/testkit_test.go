package testkit_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/km0/km0/internal/testkit"
)

// fakeT records what a helper reports instead of failing the real test.
type fakeT struct {
	testing.TB
	failed   atomic.Bool
	msg      atomic.Value
	cleanups []func()
}

func (f *fakeT) Helper()                        {}
func (f *fakeT) Cleanup(fn func())              { f.cleanups = append(f.cleanups, fn) }
func (f *fakeT) Errorf(format string, a ...any) { f.failed.Store(true); f.msg.Store(format) }
func (f *fakeT) Fatalf(format string, a ...any) {
	f.failed.Store(true)
	f.msg.Store(format)
	panic(errFatal)
}
func (f *fakeT) end() {
	for i := len(f.cleanups) - 1; i >= 0; i-- {
		f.cleanups[i]()
	}
}

var errFatal = errors.New("fatal")

func TestEventuallyReturnsOnceTheConditionHolds(t *testing.T) {
	t.Parallel()
	var n atomic.Int32
	testkit.Eventually(t, time.Minute, "the third poll", func() bool { return n.Add(1) >= 3 })
}

func TestEventuallyFailsNamingWhatItWaitedFor(t *testing.T) {
	t.Parallel()
	f := &fakeT{TB: t}
	func() {
		defer func() {
			if r := recover(); r != errFatal {
				t.Fatalf("Eventually did not fail the test (recovered %v)", r)
			}
		}()
		testkit.Eventually(f, 30*time.Millisecond, "nothing", func() bool { return false })
	}()
	if !f.failed.Load() {
		t.Fatal("Eventually of a condition that never holds did not fail")
	}
}

// Background fails the test when the function returned an error, and not
// when it returned nil at its cancellation.
func TestBackgroundFailsTheTestOnAnError(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		err  error
		fail bool
	}{{nil, false}, {errors.New("crashed"), true}} {
		f := &fakeT{TB: t}
		testkit.Background(f, "server", func(ctx context.Context) error { <-ctx.Done(); return c.err })
		f.end()
		if f.failed.Load() != c.fail {
			t.Errorf("run returned %v: test failed %v, want %v", c.err, f.failed.Load(), c.fail)
		}
	}
}

// A test that stops a Runner itself gets the error and is not failed for it.
func TestStopReturnsTheErrorToTheTest(t *testing.T) {
	t.Parallel()
	f := &fakeT{TB: t}
	want := errors.New("expected")
	r := testkit.Start(f, "relay", func(ctx context.Context) error { <-ctx.Done(); return want })
	if err := r.Stop(); !errors.Is(err, want) {
		t.Fatalf("Stop() = %v, want %v", err, want)
	}
	if err := r.Stop(); !errors.Is(err, want) {
		t.Fatalf("second Stop() = %v, want %v", err, want)
	}
	f.end()
	if f.failed.Load() {
		t.Fatal("cleanup failed the test for an error the test took")
	}
	select {
	case <-r.Done():
	default:
		t.Fatal("Done not closed after Stop")
	}
}
