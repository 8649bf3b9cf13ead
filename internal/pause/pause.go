// Package pause holds the waits the relays share: a retry backoff with
// jitter and a sleep that ends with its context.
package pause

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff is lo·2^(failures-1) capped at hi, with jitter in [d/2, d].
func Backoff(lo, hi time.Duration, failures int) time.Duration {
	d := lo
	for i := 1; i < failures && d < hi; i++ {
		d *= 2
	}
	d = min(d, hi)
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// Sleep waits d or until ctx is done, whichever comes first.
func Sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
