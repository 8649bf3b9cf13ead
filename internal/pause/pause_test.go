package pause

import (
	"context"
	"testing"
	"time"
)

// The delay doubles per failure from lo, never passes hi, and is jittered
// within [d/2, d].
func TestBackoffDoublesWithinItsBoundsWithJitter(t *testing.T) {
	lo, hi := 10*time.Millisecond, 80*time.Millisecond
	for failures, want := range map[int]time.Duration{1: lo, 2: 20 * time.Millisecond, 3: 40 * time.Millisecond, 4: hi, 9: hi} {
		for range 50 {
			if d := Backoff(lo, hi, failures); d < want/2 || d > want {
				t.Fatalf("Backoff(%v, %v, %d) = %v, want within [%v, %v]", lo, hi, failures, d, want/2, want)
			}
		}
	}
}

// Sleep returns when its context ends, not after the whole delay.
func TestSleepEndsWithItsContext(t *testing.T) {
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
