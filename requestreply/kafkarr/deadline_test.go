package kafkarr_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/requestreply/rrtest"
	"github.com/km0/km0/transport/amqp/amqptest"
)

func rawRequest(t *testing.T, pub *kgo.Client, id, replyTo string, deadline time.Time) {
	t.Helper()
	if err := pub.ProduceSync(context.Background(), &kgo.Record{Topic: kafkarr.TopicDefault, Key: []byte(id), Value: []byte(`{}`), Headers: []kgo.RecordHeader{
		{Key: kafkarr.HeaderCorrelation, Value: []byte("c-" + id)}, {Key: kafkarr.HeaderReplyTo, Value: []byte(replyTo)},
		{Key: kafkarr.HeaderRequestID, Value: []byte(id)},
		{Key: requestreply.HeaderDeadline, Value: []byte(requestreply.FormatDeadline(deadline))}}}).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// A request read after its no_despres is dropped and counted; its handler
// never runs; a fresh request is answered.
func TestExpiredRequestIsDroppedWithoutRunningTheHandler(t *testing.T) {
	b := kafkatest.New(t)
	ctx := context.Background()
	var ran sync.Map
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: func(_ context.Context, r *requestreply.Request) ([]byte, error) {
		ran.Store(r.ID, true)
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
	rawRequest(t, kafkatest.Client(t, b), "caducada", cl.ReplyTopic(), time.Now().Add(-time.Second))
	amqptest.WaitFor(t, 20*time.Second, "the expired request counted", func() bool { return srv.Stats().Expired == 1 })
	if resp, err := cl.Request(ctx, kafkarr.TopicDefault, "fresca", []byte("hola")); err != nil || string(resp) != "hola" {
		t.Fatalf("a fresh request: %q, %v", resp, err)
	}
	if _, ok := ran.Load("caducada"); ok {
		t.Fatal("the handler ran for the expired request")
	}
	if late := cl.LateReplies(); late != 0 {
		t.Fatalf("%d replies to the expired request", late)
	}
}

// A reply to a reply topic that no longer exists (its client is gone) fails
// within ReplyTimeout and holds up nothing: with a single worker, the next
// request is answered within its own timeout, and the failed reply is
// counted as unanswerable.
func TestReplyToAMissingTopicFailsFastAndBlocksNobody(t *testing.T) {
	b := kafkatest.New(t)
	ctx := context.Background()
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Workers: 1,
		Handler: func(_ context.Context, r *requestreply.Request) ([]byte, error) { return r.Body, nil }})
	if err != nil {
		t.Fatal(err)
	}
	rrtest.Background(t, srv.Run)
	// A client that got a reply (the server's producer knows its topic)
	// and is gone (its reply topic deleted).
	gone, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gone.Request(ctx, kafkarr.TopicDefault, "abans", []byte("abans")); err != nil {
		t.Fatal(err)
	}
	if err := gone.Close(); err != nil {
		t.Fatal(err)
	}
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	rawRequest(t, kafkatest.Client(t, b), "sense-client", gone.ReplyTopic(), time.Now().Add(time.Minute))
	for _, id := range []string{"despres-1", "despres-2", "despres-3"} {
		rctx, cancel := context.WithTimeout(ctx, 4*time.Second)
		resp, err := cl.Request(rctx, kafkarr.TopicDefault, id, []byte(id))
		cancel()
		if err != nil || string(resp) != id {
			t.Fatalf("%s after a reply to a missing topic: %q, %v", id, resp, err)
		}
	}
	amqptest.WaitFor(t, 20*time.Second, "the undeliverable reply counted", func() bool { return srv.Stats().Unanswerable == 1 })
	amqptest.WaitFor(t, 20*time.Second, "4 replies counted", func() bool { return srv.Stats().Replied == 4 })
}
