package kafkarr_test

import (
	"context"
	"testing"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/requestreply/rrtest"
)

// The proofs of rrtest over Kafka (kfake).
func TestConformance(t *testing.T) {
	rrtest.Run(t, func(t *testing.T, h requestreply.Handler) rrtest.Started {
		b := kafkatest.New(t)
		ctx := context.Background()
		serve := func(h requestreply.Handler) func() {
			srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: h})
			if err != nil {
				t.Fatal(err)
			}
			stop := rrtest.Stoppable(t, srv.Run)
			t.Cleanup(stop)
			return stop
		}
		stop := serve(h)
		cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := cl.Close(); err != nil {
				t.Errorf("client close: %v", err)
			}
		})
		return rrtest.Started{Requester: cl, Service: kafkarr.TopicDefault, Late: cl.LateReplies,
			StopServer: func() { stop() }, StartServer: func(h requestreply.Handler) { stop = serve(h) }}
	})
}
