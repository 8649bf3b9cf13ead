package kafkarr_test

import (
	"context"
	"testing"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/requestreply/rrtest"
)

// Proofs 1, 2 and 3 (and bad requests) over Kafka (kfake).
func TestConformance(t *testing.T) {
	rrtest.Run(t, func(t *testing.T, h requestreply.Handler) rrtest.Started {
		b := kafkatest.New(t)
		ctx := context.Background()
		srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: h})
		if err != nil {
			t.Fatal(err)
		}
		rrtest.Background(t, srv.Run)
		cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := cl.Close(); err != nil {
				t.Errorf("client close: %v", err)
			}
		})
		return rrtest.Started{Requester: cl, Service: kafkarr.TopicDefault, Late: cl.LateReplies}
	})
}
