package amqprr_test

import (
	"context"
	"testing"

	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/requestreply/rrtest"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/amqp/amqptest"
)

// A server that verifies HeaderSignature answers only requests signed with
// its key, over RabbitMQ.
func TestSignedRequestsOnly(t *testing.T) {
	rrtest.RunSigning(t, func(t *testing.T, h requestreply.Handler) (func([]byte) requestreply.Requester, string) {
		conn := amqptest.Dial(t)
		queue := amqptest.Name("t.rr.signat")
		ctx := context.Background()
		srv, err := amqprr.NewServer(ctx, amqprr.ServerConfig{Conn: conn, Queue: queue, Handler: h})
		if err != nil {
			t.Fatal(err)
		}
		rrtest.Background(t, srv.Run)
		amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue, amqp.DLQName(queue)} })
		return func(key []byte) requestreply.Requester {
			cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: conn, SigningKey: key})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = cl.Close() })
			return cl
		}, queue
	})
}
