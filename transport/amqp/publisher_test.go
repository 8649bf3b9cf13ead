package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
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
		id, _ := want.Header(contract.HeaderEventID)
		if d.MessageId != id || d.Headers[contract.HeaderEventID] != id || d.Headers[contract.HeaderType] != "prova.feta" ||
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

// One event may go to two routes at once (one message_id): a return must be
// charged to the message with the route it names, not to whichever message
// with that id is in flight first.
func TestPublishChargesAReturnToTheRouteItNamesWhenIDsRepeat(t *testing.T) {
	conn, q, pub := pubSetup(t, amqp.PublisherConfig{})
	for i := range 20 {
		routed := event(t, q, "a", i)
		lost := *routed
		lost.Topic = q + ".nowhere"
		err := pub.Publish(context.Background(), []*transport.Message{routed, &lost})
		var ret *amqp.ReturnedError
		if !errors.As(err, &ret) || len(ret.Index) != 1 || ret.Index[0] != 1 || ret.Returns[0].RoutingKey != lost.Topic {
			t.Fatalf("round %d: want only message 1 (key %s) returned, got %v", i, lost.Topic, err)
		}
	}
	if n := queueLen(t, conn, q); n != 20 {
		t.Fatalf("queue holds %d, want the 20 routable messages", n)
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
	// The default is RabbitMQ 4.x's max_message_size, 16 MiB (3.x's 128 MiB
	// would let a 4.x broker close the channel at every attempt).
	def, err := amqp.NewPublisher(context.Background(), conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	atLimit, over := event(t, q, "d", 3), event(t, q, "e", 4)
	atLimit.Value, over.Value = make([]byte, 16<<20), make([]byte, 16<<20+1)
	err = def.Publish(context.Background(), []*transport.Message{atLimit, over})
	if !errors.As(err, &rejected) || fmt.Sprint(rejected.Index) != "[1]" {
		t.Fatalf("default limit: want message 1 (16 MiB + 1) rejected, got %v", err)
	}
	if n := queueLen(t, conn, q); n != 1 {
		t.Fatalf("the 16 MiB message: queue holds %d", n)
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
			if p := d.Headers[contract.HeaderPartition]; p != strconv.Itoa(i) {
				t.Fatalf("shard %d: header %s = %v", i, contract.HeaderPartition, p)
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

// suspendQueue suspends the Erlang process of queue on the broker, so that it
// neither stores nor confirms what is published to it, until the returned
// resume runs (also at cleanup). Only this test's own queue is touched.
func suspendQueue(t *testing.T, queue string) (resume func()) {
	t.Helper()
	pid := `amqqueue:get_pid(element(2, rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"` + queue + `">>))))`
	amqptest.Rabbitmqctl(t, "eval", "sys:suspend("+pid+").")
	var once sync.Once
	resume = func() { once.Do(func() { amqptest.Rabbitmqctl(t, "eval", "sys:resume("+pid+").") }) }
	t.Cleanup(resume)
	return resume
}

// A queue that confirms late makes the broker confirm everything published
// after it out of order; the client library holds those confirms back and
// hands them over in one burst, under its sequence lock, once the late one
// comes. Publishes that start during that burst must not wedge the channel.
func TestPublishKeepsGoingThroughABurstOfOutOfOrderConfirms(t *testing.T) {
	conn := amqptest.Dial(t)
	slow, fast, other := amqptest.Name("t.pub.lenta"), amqptest.Name("t.pub.rapida"), amqptest.Name("t.pub.altra")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{slow, fast, other} })
	if err := conn.Declare(context.Background(), amqp.Topology{Queues: []amqp.Queue{{Name: slow}, {Name: fast}, {Name: other}}}); err != nil {
		t.Fatal(err)
	}
	pub, err := amqp.NewPublisher(context.Background(), conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	resume := suspendQueue(t, slow)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	const n = 10000
	msgs := []*transport.Message{event(t, slow, "s", 0)}
	for i := range n {
		msgs = append(msgs, event(t, fast, "f", i))
	}
	big := make(chan error, 1)
	go func() { big <- pub.Publish(ctx, msgs) }()
	// Other publishers keep publishing one message at a time: each waits
	// behind the slow queue's confirm, and publishes again as soon as its
	// confirm comes, in the middle of the burst.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var more atomic.Int64
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := pub.Publish(ctx, []*transport.Message{event(t, other, "g", g*1000000+i)}); err != nil {
					errs <- fmt.Errorf("publisher %d: %w", g, err)
					return
				}
				more.Add(1)
			}
		}()
	}
	// Every fast message is in its queue: the broker has confirmed them,
	// and the library holds the confirms back behind the slow one.
	testkit.Eventually(t, time.Minute, "the fast queue to hold every message", func() bool { return queueLen(t, conn, fast) >= n })
	resume()
	if err := <-big; err != nil {
		t.Fatalf("the batch published before the burst: %v", err)
	}
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if got := queueLen(t, conn, fast); got != n {
		t.Fatalf("fast queue holds %d, want %d", got, n)
	}
	if got, want := queueLen(t, conn, other), int(more.Load()); got != want {
		t.Fatalf("the other publishers' queue holds %d, want %d", got, want)
	}
	if got := queueLen(t, conn, slow); got != 1 {
		t.Fatalf("slow queue holds %d, want 1", got)
	}
}

// AMQP short strings (routing key, message_id, type, header names) hold at
// most 255 bytes. A message with a longer one is refused before anything is
// sent, for good, and the connection and the other messages are untouched:
// amqp091-go would otherwise fail while writing the frame and shut the whole
// connection down, at every attempt of the relay.
func TestPublishRejectsOverlongShortStringsWithoutDroppingTheConnection(t *testing.T) {
	conn, q, pub := pubSetup(t, amqp.PublisherConfig{})
	long := strings.Repeat("x", 256)
	longType := event(t, q, "b", 1)
	longType.Headers[0].Value = long // tipus → AMQP type
	longID := event(t, q, "c", 2)
	longID.Headers[1].Value = long // id_esdeveniment → message_id
	longName := event(t, q, "d", 3)
	longName.Headers = append(longName.Headers, transport.Header{Key: long, Value: "v"})
	longKey := event(t, long, "e", 4) // routing key
	longValue := event(t, q, "f", 5)  // a long header value and key are fine (long strings)
	longValue.Key = []byte(strings.Repeat("k", 1000))
	longValue.Headers = append(longValue.Headers, transport.Header{Key: "llarg", Value: strings.Repeat("v", 1000)})
	msgs := []*transport.Message{event(t, q, "a", 0), longType, longID, longName, longKey, longValue, event(t, q, "g", 6)}
	err := pub.Publish(context.Background(), msgs)
	var rejected *transport.RejectedError
	if !errors.As(err, &rejected) || fmt.Sprint(rejected.Index) != "[1 2 3 4]" {
		t.Fatalf("want messages [1 2 3 4] rejected for good, got %v", err)
	}
	if n := len(getAll(t, conn, q)); n != 3 {
		t.Fatalf("the 3 good messages: queue holds %d", n)
	}
	if err := pub.Publish(context.Background(), []*transport.Message{event(t, q, "h", 7)}); err != nil {
		t.Fatal(err)
	}
	if n := conn.Reconnects(); n != 0 {
		t.Fatalf("the connection was dropped %d time(s)", n)
	}
}

// With an exchange, the routing key stays the topic name (CONTRACT.md) and
// the shard travels in header particio: a foreign reader's queue bound with
// the bare topic name receives every message, and an ordered consumer's
// shard queues (SourceConfig.Topology: a headers exchange of its own bound
// with the topic name) each receive exactly the keys of their shard, in
// the order they were published. When the last shard queue is deleted, its
// headers exchange goes with it.
func TestShardedPublisherWithAnExchangeKeepsTheTopicAsRoutingKey(t *testing.T) {
	const shards, keys, perKey = 3, 10, 6
	ctx := context.Background()
	conn := amqptest.Dial(t)
	exchange := amqptest.Name("t.pub.esdeveniments")
	topic := "comandes.esdeveniments"
	amqptest.DeleteExchangesAtCleanup(t, exchange)
	src := amqp.SourceConfig{Queue: amqptest.Name("t.pub.ordered"), Exchange: exchange, RoutingKeys: []string{topic}, Shards: shards}
	topo := src.Topology()
	amqptest.DeleteQueuesAtCleanup(t, topo.QueueNames)
	foreign := amqptest.Name("t.pub.foreign")
	topo = topo.Merge(amqp.Topology{Queues: []amqp.Queue{{Name: foreign, Durable: true}},
		Bindings: []amqp.Binding{{Queue: foreign, Exchange: exchange, Key: topic}}})
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{foreign} })
	if err := conn.Declare(ctx, topo); err != nil {
		t.Fatal(err)
	}
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: exchange})
	if err != nil {
		t.Fatal(err)
	}
	sp := amqp.ShardedPublisher{Next: pub, Shards: shards}
	var msgs []*transport.Message
	for seq := range perKey {
		for k := range keys {
			msgs = append(msgs, event(t, topic, fmt.Sprintf("P-2026-%06d", k), seq))
		}
	}
	if err := sp.Publish(ctx, msgs); err != nil {
		t.Fatal(err)
	}
	if msgs[0].Topic != topic || len(msgs[0].Headers) != 2 {
		t.Fatal("ShardedPublisher modified the caller's message")
	}

	got := getAll(t, conn, foreign)
	if len(got) != keys*perKey {
		t.Fatalf("the queue bound with %q holds %d messages, want %d", topic, len(got), keys*perKey)
	}
	for _, d := range got {
		key := d.Headers[amqp.HeaderKey].(string)
		if d.RoutingKey != topic {
			t.Fatalf("routing key %q, want the topic name %q", d.RoutingKey, topic)
		}
		if p, want := d.Headers[contract.HeaderPartition], strconv.Itoa(amqp.Shard([]byte(key), shards)); p != want {
			t.Fatalf("key %s: header %s = %v, want %q", key, contract.HeaderPartition, p, want)
		}
	}
	total := 0
	for i := range shards {
		next := map[string]int{} // key → next seq expected
		for _, d := range getAll(t, conn, amqp.ShardQueueName(src.Queue, i)) {
			total++
			key := d.Headers[amqp.HeaderKey].(string)
			if s := amqp.Shard([]byte(key), shards); s != i {
				t.Fatalf("key %s in shard %d, want %d", key, i, s)
			}
			var p payload
			e, err := envelope.Decode(d.Body)
			if err == nil {
				err = e.DataAs(&p)
			}
			if err != nil {
				t.Fatal(err)
			}
			if p.Seq != next[key] {
				t.Fatalf("shard %d: key %s seq %d, want %d (order per key)", i, key, p.Seq, next[key])
			}
			next[key]++
		}
	}
	if total != keys*perKey {
		t.Fatalf("%d messages in the shards, want %d (each exactly once)", total, keys*perKey)
	}

	parts := contract.PartitionsExchangeName(src.Queue)
	if !amqptest.ExchangeExists(t, parts) {
		t.Fatalf("headers exchange %s not declared", parts)
	}
	if err := conn.Do(ctx, func(ch *amqp091.Channel) error {
		for i := range shards {
			if _, err := ch.QueueDelete(amqp.ShardQueueName(src.Queue, i), false, false, false); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if amqptest.ExchangeExists(t, parts) {
		t.Fatalf("headers exchange %s outlived its shard queues", parts)
	}
}
