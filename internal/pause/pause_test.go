package pause

import (
	"context"
	"math"
	"testing"
	"time"
)

// The delay doubles per failure from lo, never passes hi, and is jittered
// within [d/2, d].
func TestBackoffDoublesWithinItsBoundsWithJitter(t *testing.T) {
	t.Parallel()
	lo, hi := 10*time.Millisecond, 80*time.Millisecond
	for failures, want := range map[int]time.Duration{0: lo, 1: lo, 2: 20 * time.Millisecond, 3: 40 * time.Millisecond, 4: hi, 9: hi, 1 << 30: hi} {
		for range 50 {
			if d := Backoff(lo, hi, failures); d < want/2 || d > want {
				t.Fatalf("Backoff(%v, %v, %d) = %v, want within [%v, %v]", lo, hi, failures, d, want/2, want)
			}
		}
	}
}

// Two retry loops that start failing at the same instant (an outage: every
// consumer lane, every AMQP reconnect) do not retry at the same instants:
// their waits, and so the instants of their attempts, differ.
func TestLoopsStartedTogetherDoNotRetryInStep(t *testing.T) {
	t.Parallel()
	lo, hi := 100*time.Millisecond, 5*time.Second
	instants := func() []time.Duration {
		var at time.Duration
		var out []time.Duration
		for fails := 1; fails <= 10; fails++ {
			at += Backoff(lo, hi, fails)
			out = append(out, at)
		}
		return out
	}
	a, b := instants(), instants()
	same := 0
	for i := range a {
		if a[i] == b[i] {
			same++
		}
	}
	if same > 1 { // a coincidence at nanosecond resolution is possible once in ~10⁸ tries
		t.Fatalf("two loops started together retried at the same instants %d times of %d: %v and %v", same, len(a), a, b)
	}
}

// Delay is the schedule without jitter; it never overflows, whatever
// failures a retry copy claims.
func TestDelayDoublesAndNeverOverflows(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		lo, hi   time.Duration
		failures int
		want     time.Duration
	}{
		{time.Second, time.Hour, 1, time.Second},
		{time.Second, time.Hour, 3, 4 * time.Second},
		{time.Second, time.Hour, 13, time.Hour},
		{time.Second, time.Hour, 1 << 30, time.Hour},
		{time.Second, 0, 30, time.Second << 29},
		{time.Second, 0, 100, time.Duration(math.MaxInt64)},
		{time.Second, time.Hour, 0, time.Second},
	} {
		if got := Delay(c.lo, c.hi, c.failures); got != c.want {
			t.Errorf("Delay(%v, %v, %d) = %v, want %v", c.lo, c.hi, c.failures, got, c.want)
		}
	}
}

// Sleep returns when its context ends, not after the whole delay.
func TestSleepEndsWithItsContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan struct{})
	go func() { Sleep(ctx, time.Hour); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Sleep(cancelled ctx, 1h) did not return")
	}
}
