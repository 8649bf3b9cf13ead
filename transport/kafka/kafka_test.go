package kafka_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

func TestMaxMessageBytesReadsTheTopicLimit(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{"t"}, MaxMessageBytes: 10_000})
	n, err := kafka.MaxMessageBytes(context.Background(), kafkatest.Client(t, b), "t")
	if err != nil || n != 10_000 {
		t.Fatalf("max.message.bytes %d (%v), want 10000", n, err)
	}
}

// Kafka's legal topic names: a name a broker refuses for good is an error at
// once (ErrTopicRefused), never a retry loop.
func TestCheckTopicAndEnsureTopicsRefuseIllegalNames(t *testing.T) {
	for _, ok := range []string{"comandes.esdeveniments", "a", "A-b_c.9", "x"} {
		if err := kafka.CheckTopic(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	long := make([]byte, 250)
	for i := range long {
		long[i] = 't'
	}
	for _, bad := range []string{"", ".", "..", "bad topic", "comandes/esdeveniments", "cafè", string(long)} {
		if err := kafka.CheckTopic(bad); !errors.Is(err, kafka.ErrTopicRefused) {
			t.Errorf("%q: %v, want ErrTopicRefused", bad, err)
		}
	}
	b := kafkatest.New(t)
	cl := kafkatest.Client(t, b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := kafka.EnsureTopics(ctx, cl, 1, "bad topic!"); !errors.Is(err, kafka.ErrTopicRefused) || ctx.Err() != nil {
		t.Fatalf("EnsureTopics of an illegal name: %v (ctx %v), want ErrTopicRefused at once", err, ctx.Err())
	}
}

// Listening on every interface, the broker must advertise a host clients can
// dial, not "0.0.0.0" or "[::]": AdvertiseHost names it (the port is the
// listener's). A client seeded with 127.0.0.1 learns "localhost" from the
// metadata, and a round trip through it works.
func TestEmbeddedAdvertisesTheConfiguredHost(t *testing.T) {
	b := kafkatest.NewWith(t, kafkaembed.Config{Addr: "0.0.0.0:0", AdvertiseHost: "localhost", Topics: []string{"t"}})
	addrs := b.Addrs()
	if len(addrs) != 1 || !strings.HasPrefix(addrs[0], "localhost:") {
		t.Fatalf("Addrs %v, want localhost:PORT", addrs)
	}
	port := strings.TrimPrefix(addrs[0], "localhost:")
	cl, err := kafka.NewClient([]string{"127.0.0.1:" + port}, kgo.ConsumeTopics("t"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	md, err := kadm.NewClient(cl).BrokerMetadata(ctx)
	if err != nil || len(md.Brokers) != 1 || md.Brokers[0].Host != "localhost" {
		t.Fatalf("metadata %+v (%v), want one broker advertised as localhost", md.Brokers, err)
	}
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "t", Value: []byte("hola")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if fs := cl.PollRecords(ctx, 1); fs.Err0() != nil || len(fs.Records()) != 1 {
		t.Fatalf("consume: %v, %d records", fs.Err0(), len(fs.Records()))
	}
}
