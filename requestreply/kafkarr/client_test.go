package kafkarr_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
)

// Close must report that the reply topic was not deleted (a per-topic error
// in the DeleteTopics response), not return nil and leave it behind silently.
func TestCloseReportsAReplyTopicItCouldNotDelete(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t)
	ctx := context.Background()
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	b.Cluster().ControlKey(int16(kmsg.DeleteTopics), func(req kmsg.Request) (kmsg.Response, error, bool) {
		dreq := req.(*kmsg.DeleteTopicsRequest)
		resp := dreq.ResponseKind().(*kmsg.DeleteTopicsResponse)
		for _, tp := range dreq.Topics {
			rt := kmsg.NewDeleteTopicsResponseTopic()
			rt.Topic = tp.Topic
			rt.ErrorCode = kerr.TopicDeletionDisabled.Code
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
	err = cl.Close()
	topics, lerr := kadm.NewClient(kafkatest.Client(t, b)).ListTopics(ctx)
	if lerr != nil {
		t.Fatal(lerr)
	}
	if !topics.Has(cl.ReplyTopic()) {
		t.Fatalf("the reply topic is gone; the fault was not injected")
	}
	if !errors.Is(err, kerr.TopicDeletionDisabled) {
		t.Fatalf("Close returned %v with the reply topic %s left behind", err, cl.ReplyTopic())
	}
}

// A request to a service with no request topic fails with ErrNoService, as
// a request RabbitMQ returns unroutable does (R6), not with a timeout.
func TestRequestToAMissingTopicFailsWithErrNoService(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs(), Timeout: 25 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	if _, err := cl.Request(ctx, "ningu.autoritzacions", "x", []byte(`{}`)); !errors.Is(err, requestreply.ErrNoService) {
		t.Fatalf("want ErrNoService, got %v", err)
	}
}
