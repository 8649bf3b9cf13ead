package kafkarr_test

import (
	"context"
	"testing"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/requestreply/rrtest"
)

// A server that verifies HeaderSignature answers only requests signed with
// its key, over Kafka (kfake).
func TestSignedRequestsOnly(t *testing.T) {
	rrtest.RunSigning(t, func(t *testing.T, h requestreply.Handler) (func([]byte) requestreply.Requester, string) {
		b := kafkatest.New(t)
		ctx := context.Background()
		srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: h})
		if err != nil {
			t.Fatal(err)
		}
		rrtest.Background(t, srv.Run)
		return func(key []byte) requestreply.Requester {
			cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs(), SigningKey: key})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = cl.Close() })
			return cl
		}, kafkarr.TopicDefault
	})
}
