package kafkarr_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/rrtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

func signedServer(t *testing.T, h requestreply.Handler, key []byte) (*kafkaembed.Broker, *kafkarr.Server) {
	b := kafkatest.New(t)
	srv, err := kafkarr.NewServer(context.Background(), kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: h, SigningKey: key})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Background(t, "server", srv.Run)
	return b, srv
}

// Over Kafka: a server with a SigningKey answers only requests signed with
// it, and its requesters take only its replies, whatever another reader of
// the request topic answers first.
func TestSigning(t *testing.T) {
	t.Parallel()
	rrtest.RunSigning(t, func(t *testing.T, h requestreply.Handler, key []byte) rrtest.Signed {
		b, srv := signedServer(t, h, key)
		ctx := context.Background()
		return rrtest.Signed{
			Service: kafkarr.TopicDefault,
			Refused: func() int64 { return srv.Stats().Unauthenticated },
			Requester: func(key []byte) (requestreply.Requester, func() int64, func() int64) {
				cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs(), SigningKey: key})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = cl.Close() })
				return cl, cl.DroppedReplies, cl.LateReplies
			},
			Rogue: func(key, body []byte) func() int64 { return rogue(t, b, key, body) },
		}
	})
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// rogue reads the request topic in a group of its own (it sees every
// request) and answers each with ok and body, signed with key (nil:
// unsigned) as a server would.
func rogue(t *testing.T, b *kafkaembed.Broker, key, body []byte) func() int64 {
	cl := kafkatest.Client(t, b, kgo.ConsumeTopics(kafkarr.TopicDefault), kgo.ConsumerGroup(requestreply.NewIDs().Prefix()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	var answered atomic.Int64
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
				corr, to := header(r, contract.HeaderCorrelator), header(r, kafkarr.HeaderReplyTo)
				rep := &kgo.Record{Topic: to, Value: body, Headers: []kgo.RecordHeader{
					{Key: contract.HeaderCorrelator, Value: []byte(corr)}, {Key: requestreply.HeaderResult, Value: []byte(requestreply.ResultOK)}}}
				if key != nil {
					rep.Headers = append(rep.Headers, kgo.RecordHeader{Key: requestreply.HeaderSignature,
						Value: []byte(requestreply.SignReply(key, header(r, kafkarr.HeaderRequestID), corr, to, requestreply.ResultOK, body))})
				}
				if cl.ProduceSync(ctx, rep).FirstErr() == nil {
					answered.Add(1)
				}
			})
		}
	}()
	return answered.Load
}

// A request read from the topic (anyone who reads it sees respondre_a and
// correlacio), produced again before its deadline with another respondre_a,
// is refused without running the handler: the signature covers respondre_a.
// The same record with the respondre_a it was signed for is answered (the
// capture is genuine).
func TestReplayToAnotherReplyTopicIsRefused(t *testing.T) {
	t.Parallel()
	var ran atomic.Int64
	b, srv := signedServer(t, func(context.Context, *requestreply.Request) ([]byte, error) {
		ran.Add(1)
		return []byte(`{"aprovada":true}`), nil
	}, rrtest.KeyShared)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := kafkatest.Client(t, b)
	genuine, attacker := kafkarr.ReplyTopicPrefix+"genuina", kafkarr.ReplyTopicPrefix+"atacant"
	if err := kafka.EnsureTopics(ctx, cl, 1, genuine, attacker); err != nil {
		t.Fatal(err)
	}
	body := []byte(`{"comanda_id":"c-1","import_centims":100}`)
	deadline := requestreply.FormatDeadline(time.Now().Add(10 * time.Second))
	sig := requestreply.Sign(rrtest.KeyShared, kafkarr.TopicDefault, "autoritzacio-c-1", "corr-1", genuine, deadline, body)
	for _, to := range []string{genuine, attacker} {
		rec := &kgo.Record{Topic: kafkarr.TopicDefault, Key: []byte("autoritzacio-c-1"), Value: body, Headers: []kgo.RecordHeader{
			{Key: contract.HeaderCorrelator, Value: []byte("corr-1")}, {Key: kafkarr.HeaderReplyTo, Value: []byte(to)},
			{Key: kafkarr.HeaderRequestID, Value: []byte("autoritzacio-c-1")}, {Key: requestreply.HeaderDeadline, Value: []byte(deadline)},
			{Key: requestreply.HeaderSignature, Value: []byte(sig)}}}
		if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
		got := kafkatest.ReadAll(t, b, to, 1, 15*time.Second)
		if len(got) != 1 {
			t.Fatalf("%d replies on %s, want 1", len(got), to)
		}
		if to == genuine && string(got[0].Value) != `{"aprovada":true}` {
			t.Fatalf("the request to the reply topic it was signed for: got %s", got[0].Value)
		}
		if to == attacker {
			var eb struct{ Error string }
			_ = json.Unmarshal(got[0].Value, &eb)
			if eb.Error != requestreply.ErrUnauthenticated.Error() {
				t.Fatalf("the replay to another reply topic: got %s, want the ErrUnauthenticated error reply", got[0].Value)
			}
		}
	}
	if n, r := ran.Load(), srv.Stats().Unauthenticated; n != 1 || r != 1 {
		t.Fatalf("handler ran %d times and %d requests were refused: want 1 and 1", n, r)
	}
}
