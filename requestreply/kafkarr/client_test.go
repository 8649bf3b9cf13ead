package kafkarr_test

import (
	"context"
	"errors"
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/requestreply/kafkarr"
)

// Close must report that the reply topic was not deleted (a per-topic error
// in the DeleteTopics response), not return nil and leave it behind silently.
func TestCloseReportsAReplyTopicItCouldNotDelete(t *testing.T) {
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
