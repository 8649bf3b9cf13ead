package kafkarr_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/requestreply/rrtest"
	"github.com/km0/km0/transport/amqp/amqptest"
)

// A reply over the producer's record limit (1 MiB) cannot go to Kafka. The
// requester must get a non-retryable error reply saying so, not a timeout
// (R5), and the requests after it their own replies.
func TestReplyTooLargeForKafkaGetsAnErrorReply(t *testing.T) {
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
	rrtest.Background(t, srv.Run)
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
	amqptest.WaitFor(t, 20*time.Second, "2 replies counted", func() bool { return srv.Stats().Replied == 2 })
	if st := srv.Stats(); st.Replied != 2 || st.ErrorReplies != 1 || st.Unanswerable != 0 {
		t.Fatalf("stats %+v, want 2 replied, 1 error reply, 0 unanswerable", st)
	}
}
