package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/amqp/amqptest"
)

// declareQueue declares a plain durable queue, deleted at cleanup.
func declareQueue(t *testing.T, conn *amqp.Conn, name string) {
	t.Helper()
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{name} })
	if err := conn.Declare(context.Background(), amqp.Topology{Queues: []amqp.Queue{{Name: name, Durable: true}}}); err != nil {
		t.Fatal(err)
	}
}

// pubSetup returns a connection, a fresh queue and a publisher with cfg.
func pubSetup(t *testing.T, cfg amqp.PublisherConfig) (*amqp.Conn, string, *amqp.Publisher) {
	t.Helper()
	conn := amqptest.Dial(t)
	q := amqptest.Name("t.pub")
	declareQueue(t, conn, q)
	pub, err := amqp.NewPublisher(context.Background(), conn, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return conn, q, pub
}

func TestPublishConfirmsEveryMessageWithContractHeaders(t *testing.T) {
	conn, q, pub := pubSetup(t, amqp.PublisherConfig{})
	var msgs []*transport.Message
	for i := range 300 {
		msgs = append(msgs, event(t, q, fmt.Sprintf("K%d", i%7), i))
	}
	if err := pub.Publish(context.Background(), msgs); err != nil {
		t.Fatal(err)
	}
	got := getAll(t, conn, q)
	if len(got) != 300 {
		t.Fatalf("queue holds %d messages, want 300", len(got))
	}
	for i, d := range got {
		want := msgs[i]
		id, _ := want.Header(transport.HeaderEventID)
		if d.MessageId != id || d.Headers[transport.HeaderEventID] != id || d.Headers[transport.HeaderType] != "prova.feta" ||
			d.Type != "prova.feta" || d.DeliveryMode != amqp091.Persistent || string(d.Body) != string(want.Value) ||
			d.Headers[amqp.HeaderKey] != string(want.Key) {
			t.Fatalf("message %d: got %+v", i, d)
		}
		back := amqp.FromDelivery(&d)
		if string(back.Key) != string(want.Key) || back.Topic != q {
			t.Fatalf("FromDelivery: key %q topic %q", back.Key, back.Topic)
		}
	}
}

func TestPublishReportsReturnedMessagesAndConfirmsTheOthers(t *testing.T) {
	conn, q, pub := pubSetup(t, amqp.PublisherConfig{})
	msgs := []*transport.Message{event(t, q, "a", 0), event(t, q+".no-such-queue", "b", 1), event(t, q, "c", 2),
		event(t, q+".no-such-queue-either", "d", 3)}
	err := pub.Publish(context.Background(), msgs)
	var ret *amqp.ReturnedError
	if !errors.As(err, &ret) || !errors.Is(err, amqp.ErrUnroutable) {
		t.Fatalf("want a *ReturnedError, got %v", err)
	}
	if len(ret.Index) != 2 || ret.Index[0] != 1 || ret.Index[1] != 3 || ret.Returns[0].ReplyCode != 312 {
		t.Fatalf("returned %v (%v), want indexes [1 3] with 312 NO_ROUTE", ret.Index, ret)
	}
	var rejected *transport.RejectedError
	if errors.As(err, &rejected) {
		t.Fatal("an unroutable message must not be reported as rejected for good")
	}
	if n := len(getAll(t, conn, q)); n != 2 {
		t.Fatalf("the 2 routable messages: queue holds %d", n)
	}
	// The channel survives a return: the next publish is confirmed.
	if err := pub.Publish(context.Background(), []*transport.Message{event(t, q, "e", 4)}); err != nil {
		t.Fatal(err)
	}
}

func TestPublishRejectsOversizedMessagesForGood(t *testing.T) {
	conn, q, pub := pubSetup(t, amqp.PublisherConfig{MaxMessageBytes: 1000})
	big := event(t, q, "b", 1)
	big.Value = make([]byte, 5000)
	err := pub.Publish(context.Background(), []*transport.Message{event(t, q, "a", 0), big, event(t, q, "c", 2)})
	var rejected *transport.RejectedError
	if !errors.As(err, &rejected) || len(rejected.Index) != 1 || rejected.Index[0] != 1 {
		t.Fatalf("want message 1 rejected for good, got %v", err)
	}
	if n := len(getAll(t, conn, q)); n != 2 {
		t.Fatalf("the 2 good messages: queue holds %d", n)
	}
}

func TestPublishFromManyGoroutinesMatchesEveryConfirm(t *testing.T) {
	conn, q, pub := pubSetup(t, amqp.PublisherConfig{})
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for g := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10 {
				// Every other batch holds one unroutable message: its return must
				// be charged to this batch only.
				msgs := []*transport.Message{event(t, q, "k", g*100+i), event(t, q, "k", g*100+i)}
				if i%2 == 1 {
					msgs = append(msgs, event(t, q+".nowhere", "k", 0))
				}
				err := pub.Publish(context.Background(), msgs)
				var ret *amqp.ReturnedError
				switch {
				case i%2 == 0 && err != nil:
					errs <- fmt.Errorf("goroutine %d batch %d: %w", g, i, err)
				case i%2 == 1 && (!errors.As(err, &ret) || len(ret.Index) != 1 || ret.Index[0] != 2):
					errs <- fmt.Errorf("goroutine %d batch %d: want index 2 returned, got %v", g, i, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := queueLen(t, conn, q); n != 400 {
		t.Fatalf("queue holds %d, want 400", n)
	}
}

func TestShardedPublisherRoutesEachKeyToOneShard(t *testing.T) {
	conn := amqptest.Dial(t)
	q := amqptest.Name("t.pub")
	for i := range 3 {
		declareQueue(t, conn, amqp.ShardQueueName(q, i))
	}
	pub, err := amqp.NewPublisher(context.Background(), conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	sp := amqp.ShardedPublisher{Next: pub, Shards: 3}
	var msgs []*transport.Message
	for i := range 60 {
		msgs = append(msgs, event(t, q, fmt.Sprintf("P-%d", i%10), i))
	}
	if err := sp.Publish(context.Background(), msgs); err != nil {
		t.Fatal(err)
	}
	if msgs[0].Topic != q {
		t.Fatal("ShardedPublisher modified the caller's message")
	}
	total := 0
	for i := range 3 {
		for _, d := range getAll(t, conn, amqp.ShardQueueName(q, i)) {
			total++
			if s := amqp.Shard([]byte(d.Headers[amqp.HeaderKey].(string)), 3); s != i {
				t.Fatalf("key %v in shard %d, want %d", d.Headers[amqp.HeaderKey], i, s)
			}
		}
	}
	if total != 60 {
		t.Fatalf("%d messages in the shards, want 60", total)
	}
	if err := sp.Publish(context.Background(), []*transport.Message{{Topic: q, Value: []byte("{}")}}); err == nil {
		t.Fatal("a message without key must be refused in ordered mode")
	}
}
