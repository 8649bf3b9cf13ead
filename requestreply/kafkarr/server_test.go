package kafkarr_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
)

// A reply over the producer's record limit (1 MiB) cannot go to Kafka. The
// requester must get a non-retryable error reply saying so, not a timeout
// (R5), and the requests after it their own replies.
func TestReplyTooLargeForKafkaGetsAnErrorReply(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t)
	ctx := context.Background()
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: func(_ context.Context, r *requestreply.Request) ([]byte, error) {
		if string(r.Body) == "gran" {
			return bytes.Repeat([]byte("x"), 2<<20), nil
		}
		return r.Body, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Background(t, "server", srv.Run)
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	_, err = cl.Request(ctx, kafkarr.TopicDefault, "gran-1", []byte("gran"))
	var re *requestreply.RemoteError
	if !errors.As(err, &re) || re.Retryable || !strings.Contains(re.Message, "too large") {
		t.Fatalf("want a non-retryable error reply about the reply's size, got %v", err)
	}
	resp, err := cl.Request(ctx, kafkarr.TopicDefault, "petita-1", []byte("petita"))
	if err != nil || string(resp) != "petita" {
		t.Fatalf("the next request got %q, %v", resp, err)
	}
	// The server counts a reply after its ack, which may come after the requester has it.
	testkit.Eventually(t, 20*time.Second, "2 replies counted", func() bool { return srv.Stats().Replied == 2 })
	if st := srv.Stats(); st.Replied != 2 || st.ErrorReplies != 1 || st.Unanswerable != 0 {
		t.Fatalf("stats %+v, want 2 replied, 1 error reply, 0 unanswerable", st)
	}
}

// A request may name only a reply topic as its respondre_a: one that names a
// business topic (here the domain topic comandes.esdeveniments) is skipped
// and counted, and nothing is written there; a real client's request still
// gets its reply.
func TestServerRepliesOnlyToReplyTopics(t *testing.T) {
	t.Parallel()
	const business = "comandes.esdeveniments"
	b := kafkatest.New(t, business)
	ctx := context.Background()
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(),
		Handler: func(_ context.Context, r *requestreply.Request) ([]byte, error) { return r.Body, nil }})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Background(t, "server", srv.Run)
	pub := kafkatest.Client(t, b)
	if err := pub.ProduceSync(ctx, &kgo.Record{Topic: kafkarr.TopicDefault, Key: []byte("x"), Value: []byte(`{"fals":true}`), Headers: []kgo.RecordHeader{
		{Key: contract.HeaderCorrelator, Value: []byte("c-1")}, {Key: kafkarr.HeaderReplyTo, Value: []byte(business)},
		{Key: kafkarr.HeaderRequestID, Value: []byte("x")}}}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	if resp, err := cl.Request(ctx, kafkarr.TopicDefault, "y", []byte("hola")); err != nil || string(resp) != "hola" {
		t.Fatalf("a real request: %q, %v", resp, err)
	}
	// The server counts a reply after its ack, which may come after the requester has it.
	testkit.Eventually(t, 20*time.Second, "the forged request and the reply counted", func() bool {
		st := srv.Stats()
		return st.Unanswerable == 1 && st.Replied == 1
	})

	adm := kadm.NewClient(pub)
	ends, err := adm.ListEndOffsets(ctx, business)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
	if st := srv.Stats(); n != 0 || st.Replied != 1 || st.Unanswerable != 1 {
		t.Fatalf("%d records written to %s, stats %+v; want 0, 1 replied, 1 unanswerable", n, business, st)
	}
}
