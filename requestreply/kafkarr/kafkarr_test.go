package kafkarr_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/rrtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/transport/kafka"
)

// The proofs of rrtest over Kafka (kfake).
func TestConformance(t *testing.T) {
	t.Parallel()
	runConformance(t, func(t *testing.T) ([]string, []kgo.Opt) { return kafkatest.New(t).Addrs(), nil })
}

// TestConformanceSecured: the proofs of rrtest over kfake with SASL
// SCRAM-SHA-512 over TLS (a test CA) and with SASL PLAIN, the server's and
// the client's Kafka clients all given kafka.Security's options (KgoOpts).
func TestConformanceSecured(t *testing.T) {
	t.Parallel()
	for _, cfg := range []kafkatest.SecureConfig{
		{Mechanism: kafka.SASLScramSHA512, TLS: true},
		{Mechanism: kafka.SASLPlain},
	} {
		t.Run(cfg.Mechanism, func(t *testing.T) {
			runConformance(t, func(t *testing.T) ([]string, []kgo.Opt) {
				b := kafkatest.NewSecure(t, cfg)
				return b.Addrs(), b.Opts(t)
			})
		})
	}
}

// runConformance runs rrtest against the broker newBroker starts for each case.
func runConformance(t *testing.T, newBroker func(t *testing.T) ([]string, []kgo.Opt)) {
	rrtest.Run(t, func(t *testing.T, h requestreply.Handler) rrtest.Started {
		brokers, opts := newBroker(t)
		ctx := context.Background()
		serve := func(h requestreply.Handler) func() {
			srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: brokers, Handler: h, KgoOpts: opts})
			if err != nil {
				t.Fatal(err)
			}
			stop := rrtest.Stoppable(t, srv.Run)
			t.Cleanup(stop)
			return stop
		}
		stop := serve(h)
		waitServing(t, brokers, opts)
		cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: brokers, KgoOpts: opts})
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

// waitServing waits until the server's group is Stable with its partitions
// assigned, so that a case's first request (with a deadline of 300 ms) does
// not wait for the join: over TLS and SCRAM each connection of the server
// takes a handshake and a PBKDF2 first.
func waitServing(t *testing.T, brokers []string, opts []kgo.Opt) {
	t.Helper()
	group := kafkarr.TopicDefault + ".servidor"
	adm := kadm.NewClient(kafkatest.ClientFor(t, brokers, opts...))
	testkit.Eventuallyf(t, 30*time.Second, "group "+group+" Stable with an assigned member", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		gs, err := adm.DescribeGroups(ctx, group)
		cancel()
		if g, ok := gs[group]; err == nil && ok && g.Err == nil && g.State == "Stable" && len(g.Members) > 0 {
			if _, assigned := g.Members[0].Assigned.AsConsumer(); assigned {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%v %+v", err, gs[group])
	})
}
