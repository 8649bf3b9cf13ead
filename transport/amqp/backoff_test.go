package amqp

import (
	"testing"
	"time"
)

// Two Conns that lost the broker together (an outage) do not dial again in
// lockstep: the waits of their reconnect loops (and of their subscriptions'
// resubscribe loops, which wait the same backoff) differ, and stay within
// [ReconnectMin/2, ReconnectMax].
func TestReconnectWaitsOfTwoConnsDiffer(t *testing.T) {
	t.Parallel()
	cfg := Config{ReconnectMin: 100 * time.Millisecond, ReconnectMax: 5 * time.Second}
	a, b := &Conn{cfg: cfg}, &Conn{cfg: cfg}
	var atA, atB time.Duration
	same := 0
	for fails := 1; fails <= 10; fails++ {
		wa, wb := a.backoff(fails), b.backoff(fails)
		for _, w := range []time.Duration{wa, wb} {
			if w < cfg.ReconnectMin/2 || w > cfg.ReconnectMax {
				t.Fatalf("wait %v after %d failures, want within [%v, %v]", w, fails, cfg.ReconnectMin/2, cfg.ReconnectMax)
			}
		}
		atA, atB = atA+wa, atB+wb
		if atA == atB {
			same++
		}
	}
	if same > 1 {
		t.Fatalf("the two reconnect loops dialled at the same instant %d times of 10", same)
	}
}
