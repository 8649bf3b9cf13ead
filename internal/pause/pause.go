// Package pause holds km0's one retry backoff, jittered, and a sleep that
// ends with its context. Every retry loop of km0 (relays, consumer lanes,
// sources, AMQP reconnects, the DLQ indexer and webhook) waits Backoff, so
// loops that start failing together (an outage) spread their attempts
// instead of retrying in lockstep.
package pause

import (
	"context"
	"math"
	"math/rand/v2"
	"time"
)

// Backoff is the wait after the failures-th consecutive failure: Delay(lo,
// hi, failures) jittered down by up to a half, uniformly within [d/2, d].
// So it never waits longer than the schedule says, and two loops that
// failed at the same instant retry at different ones.
func Backoff(lo, hi time.Duration, failures int) time.Duration {
	d := Delay(lo, hi, failures)
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// Delay is the schedule without jitter: lo·2^(failures−1), capped at hi (a
// hi ≤ 0 means no cap other than overflow); failures below 1 count as 1. It
// never overflows, whatever failures is. The message retry delays (Backoff ×
// 2^(attempt−1), outcome.Backoff) are Delay itself: the contract states them,
// and RabbitMQ names its wait queues after them (<queue>.espera.<ms>).
func Delay(lo, hi time.Duration, failures int) time.Duration {
	if hi <= 0 {
		hi = time.Duration(math.MaxInt64)
	}
	d := lo
	for i := 1; i < failures && d < hi; i++ {
		if d > hi/2 {
			return hi
		}
		d *= 2
	}
	return min(d, hi)
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
