package amqp

import (
	"testing"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/transport"
)

// A retry whose copy could not be published becomes a dead letter whose
// motiu says so in English, after the contract's exhausted prefix.
func TestDeadInsteadSaysTheRetryCouldNotBeScheduled(t *testing.T) {
	f := &transport.Settlement{LastError: "timeout calling pagaments"}
	(&Source{}).deadInstead(f, errNoCopy)
	want := contract.ReasonExhausted + "could not schedule the retry (retry copy not published): timeout calling pagaments"
	if !f.Dead || f.Reason != want {
		t.Fatalf("dead %v, motiu %q\nwant %q", f.Dead, f.Reason, want)
	}
}
