package amqprr_test

import (
	"testing"
	"time"

	"github.com/km0/km0/internal/amqptest"
)

// The request/reply proofs (rrtest, with an exclusive reply queue, direct
// reply-to and coalesced writes) pass over amqps://, through a TLS listener
// with a certificate of the test's own CA in front of the machine's
// RabbitMQ.
func TestConformanceOverTLS(t *testing.T) {
	t.Parallel()
	amqptest.RunSuitesOverTLS(t, "^TestConformance$", 3*time.Minute)
}
