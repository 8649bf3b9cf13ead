package kafka_test

import (
	"context"
	"crypto/rand"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

func TestPublishConfirmsEveryRecordAndKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, "t.esdeveniments")
	pub := kafka.NewPublisher(kafkatest.Client(t, b))
	var msgs []*transport.Message
	for i := range 300 {
		key := []string{"A", "B", "C"}[i%3]
		msgs = append(msgs, &transport.Message{Topic: "t.esdeveniments", Key: []byte(key),
			Value: []byte{byte(i / 3)}, Headers: []transport.Header{{Key: "tipus", Value: "x"}}})
	}
	if err := pub.Publish(context.Background(), msgs); err != nil {
		t.Fatal(err)
	}
	recs := kafkatest.ReadAll(t, b, "t.esdeveniments", 300, 10*time.Second)
	if len(recs) != 300 {
		t.Fatalf("read %d records, want 300", len(recs))
	}
	next := map[string]byte{}
	for _, r := range recs {
		if r.Value[0] != next[string(r.Key)] {
			t.Fatalf("key %s: got %d, want %d", r.Key, r.Value[0], next[string(r.Key)])
		}
		next[string(r.Key)]++
	}
}

func TestPublishReportsRecordsRejectedForGood(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewWith(t, kafka.EmbeddedConfig{Topics: []string{"t"}, MaxMessageBytes: 10_000})
	pub := kafka.NewPublisher(kafkatest.Client(t, b))
	msgs := []*transport.Message{
		{Topic: "t", Key: []byte("a"), Value: []byte("small")},
		{Topic: "t", Key: []byte("b"), Value: incompressible(50_000)},
		{Topic: "t", Key: []byte("c"), Value: []byte("small too")},
	}
	err := pub.Publish(context.Background(), msgs)
	var rej *transport.RejectedError
	if !errors.As(err, &rej) || len(rej.Index) != 1 || rej.Index[0] != 1 {
		t.Fatalf("want record 1 rejected for good, got %v", err)
	}
	if recs := kafkatest.ReadAll(t, b, "t", 2, 5*time.Second); len(recs) != 2 {
		t.Fatalf("the 2 good records were not published: %d", len(recs))
	}
}

// incompressible returns n random bytes: a repeated byte would compress under
// the broker's limit.
func incompressible(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func TestPublishCarriesTheCallersTrace(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, "t")
	pub := kafka.NewPublisher(kafkatest.Client(t, b))
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
	m := &transport.Message{Topic: "t", Key: []byte("k"), Value: []byte("v")}
	if err := pub.Publish(ctx, []*transport.Message{m}); err != nil {
		t.Fatal(err)
	}
	if len(m.Headers) != 0 {
		t.Fatalf("Publish wrote into the caller's message: %v", m.Headers)
	}
	recs := kafkatest.ReadAll(t, b, "t", 1, 5*time.Second)
	if len(recs) != 1 {
		t.Fatalf("read %d records", len(recs))
	}
	got := trace.SpanContextFromContext(tracing.Extract(context.Background(), kafka.FromRecord(recs[0])))
	if got.TraceID() != tid {
		t.Fatalf("consumer side trace %v, want %v", got.TraceID(), tid)
	}
}

func TestMaxMessageBytesReadsTheTopicLimit(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewWith(t, kafka.EmbeddedConfig{Topics: []string{"t"}, MaxMessageBytes: 10_000})
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

// Records that each fit the broker's limit are never rejected for good, even
// when the client batches several of them over that limit.
func TestPublishNeverRejectsRecordsThatFitTheLimit(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewWith(t, kafka.EmbeddedConfig{Topics: []string{"t"}, MaxMessageBytes: 10_000})
	pub := kafka.NewPublisher(kafkatest.Client(t, b))
	var msgs []*transport.Message
	for range 40 {
		msgs = append(msgs, &transport.Message{Topic: "t", Key: []byte("a"), Value: incompressible(2_000)})
	}
	if err := pub.Publish(context.Background(), msgs); err != nil {
		t.Fatalf("40 records of 2000 bytes under a 10000-byte limit: %v", err)
	}
	if recs := kafkatest.ReadAll(t, b, "t", 40, 5*time.Second); len(recs) != 40 {
		t.Fatalf("read %d records, want 40", len(recs))
	}
}

// Listening on every interface, the broker must advertise a host clients can
// dial, not "0.0.0.0" or "[::]": AdvertiseHost names it (the port is the
// listener's). A client seeded with 127.0.0.1 learns "localhost" from the
// metadata, and a round trip through it works.
func TestEmbeddedAdvertisesTheConfiguredHost(t *testing.T) {
	b := kafkatest.NewWith(t, kafka.EmbeddedConfig{Addr: "0.0.0.0:0", AdvertiseHost: "localhost", Topics: []string{"t"}})
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
