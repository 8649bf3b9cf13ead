package kafka_test

import (
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/transport/kafka"
)

func TestGroupOptsSetTheSessionAndAHeartbeatOfAThirdAtMostOneSecond(t *testing.T) {
	for _, tc := range []struct{ session, wantSession, wantHeartbeat time.Duration }{
		{0, kafka.SessionTimeoutDefault, time.Second},
		{45 * time.Second, 45 * time.Second, time.Second},
		{1500 * time.Millisecond, 1500 * time.Millisecond, 500 * time.Millisecond},
	} {
		opts := append(kafka.GroupOpts(tc.session), kgo.SeedBrokers("127.0.0.1:1"), kgo.ConsumerGroup("g"), kgo.ConsumeTopics("t"))
		cl, err := kgo.NewClient(opts...)
		if err != nil {
			t.Fatal(err)
		}
		s, h := cl.OptValue(kgo.SessionTimeout), cl.OptValue(kgo.HeartbeatInterval)
		cl.Close()
		if s != tc.wantSession || h != tc.wantHeartbeat {
			t.Errorf("GroupOpts(%v): session %v, heartbeat %v; want %v, %v", tc.session, s, h, tc.wantSession, tc.wantHeartbeat)
		}
	}
}
