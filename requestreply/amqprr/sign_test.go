package amqprr_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/rrtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/transport/amqp"
)

func signedServer(t *testing.T, h requestreply.Handler, key []byte) (*amqp.Conn, *amqprr.Server, string) {
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.rr.signat")
	srv, err := amqprr.NewServer(context.Background(), amqprr.ServerConfig{Conn: conn, Queue: queue, Handler: h, SigningKey: key})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Background(t, "server", srv.Run)
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue, contract.DLQName(queue)} })
	return conn, srv, queue
}

// Over RabbitMQ: a server with a SigningKey answers only requests signed
// with it, and its requesters take only its replies, whatever a competing
// consumer of the queue answers; with an exclusive reply queue and with
// direct reply-to (whose address the server sees with a token the requester
// never knew).
func TestSigning(t *testing.T) {
	t.Parallel()
	for _, direct := range []bool{false, true} {
		t.Run(map[bool]string{false: "ExclusiveQueue", true: "DirectReplyTo"}[direct], func(t *testing.T) {
			rrtest.RunSigning(t, func(t *testing.T, h requestreply.Handler, key []byte) rrtest.Signed {
				conn, srv, queue := signedServer(t, h, key)
				ctx := context.Background()
				return rrtest.Signed{
					Service: queue,
					Refused: func() int64 { return srv.Stats().Unauthenticated },
					Requester: func(key []byte) (requestreply.Requester, func() int64, func() int64) {
						cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: conn, SigningKey: key, DirectReplyTo: direct})
						if err != nil {
							t.Fatal(err)
						}
						t.Cleanup(func() { _ = cl.Close() })
						return cl, cl.DroppedReplies, cl.LateReplies
					},
					Rogue: func(key, body []byte) func() int64 { return rogue(t, conn, queue, key, body) },
				}
			})
		})
	}
}

// rogue consumes queue beside the server and answers every request it gets
// with ok and body, signed with key (nil: unsigned) as a server would.
func rogue(t *testing.T, conn *amqp.Conn, queue string, key, body []byte) func() int64 {
	ch, err := conn.Channel(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.Close() })
	ds, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var answered atomic.Int64
	go func() {
		for d := range ds {
			h := amqp091.Table{requestreply.HeaderResult: requestreply.ResultOK}
			if key != nil {
				h[requestreply.HeaderSignature] = requestreply.SignReply(key, d.MessageId, d.CorrelationId, d.ReplyTo, requestreply.ResultOK, body)
			}
			if ch.PublishWithContext(context.Background(), "", d.ReplyTo, false, false, amqp091.Publishing{Headers: h, CorrelationId: d.CorrelationId, Body: body}) == nil {
				answered.Add(1)
			}
		}
	}()
	return answered.Load
}

// A captured signed request, republished before its deadline with another
// reply_to, is refused without running the handler: the signature covers
// reply_to. The same bytes with the reply_to they were signed for are
// answered (the capture is genuine).
func TestReplayToAnotherReplyQueueIsRefused(t *testing.T) {
	t.Parallel()
	var ran atomic.Int64
	conn, srv, queue := signedServer(t, func(context.Context, *requestreply.Request) ([]byte, error) {
		ran.Add(1)
		return []byte(`{"aprovada":true}`), nil
	}, rrtest.KeyShared)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ch, err := conn.Channel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	replies := map[string]<-chan amqp091.Delivery{}
	var names []string // the genuine requester's reply queue, the attacker's
	for range 2 {
		q, err := ch.QueueDeclare("", false, true, true, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if replies[q.Name], err = ch.Consume(q.Name, "", true, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
		names = append(names, q.Name)
	}
	genuine, attacker := names[0], names[1]
	body := []byte(`{"comanda_id":"c-1","import_centims":100}`)
	deadline := requestreply.FormatDeadline(time.Now().Add(10 * time.Second))
	sig := requestreply.Sign(rrtest.KeyShared, queue, "autoritzacio-c-1", "corr-1", genuine, deadline, body)
	for _, to := range []string{genuine, attacker} {
		err := ch.PublishWithContext(ctx, "", queue, true, false, amqp091.Publishing{CorrelationId: "corr-1", MessageId: "autoritzacio-c-1", ReplyTo: to,
			Headers: amqp091.Table{requestreply.HeaderDeadline: deadline, requestreply.HeaderSignature: sig}, Body: body})
		if err != nil {
			t.Fatal(err)
		}
		var d amqp091.Delivery
		select {
		case d = <-replies[to]:
		case <-ctx.Done():
			t.Fatalf("no reply to %s", to)
		}
		got := string(d.Body)
		if to == genuine && got != `{"aprovada":true}` {
			t.Fatalf("the request to the reply queue it was signed for: got %s", got)
		}
		if to == attacker {
			var eb struct{ Error string }
			_ = json.Unmarshal(d.Body, &eb)
			if eb.Error != requestreply.ErrUnauthenticated.Error() {
				t.Fatalf("the replay to another reply queue: got %s, want the ErrUnauthenticated error reply", got)
			}
		}
	}
	if n, r := ran.Load(), srv.Stats().Unauthenticated; n != 1 || r != 1 {
		t.Fatalf("handler ran %d times and %d requests were refused: want 1 and 1", n, r)
	}
}
