package amqprr_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
)

// A request that reaches the server after its no_despres (published without
// an AMQP expiration, as a client of another broker would, so that RabbitMQ
// delivers it) is acked and counted, its handler never runs and no reply is
// sent; a fresh request meanwhile is answered.
func TestExpiredRequestIsDroppedWithoutRunningTheHandler(t *testing.T) {
	t.Parallel()
	var ran sync.Map
	srv, cl, queue := start(t, func(_ context.Context, r *requestreply.Request) ([]byte, error) {
		ran.Store(r.ID, true)
		return []byte(`{"ok":true}`), nil
	})
	conn := amqptest.Dial(t)
	replyQueue := amqptest.Name("t.rr.resposta")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{replyQueue} })
	if err := conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		if _, err := ch.QueueDeclare(replyQueue, false, false, false, false, nil); err != nil {
			return err
		}
		return ch.PublishWithContext(context.Background(), "", queue, true, false, amqp091.Publishing{
			Headers:   amqp091.Table{requestreply.HeaderDeadline: requestreply.FormatDeadline(time.Now().Add(-time.Second))},
			MessageId: "caducada", CorrelationId: "c-caducada", ReplyTo: replyQueue, Body: []byte(`{}`)})
	}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the expired request counted", func() bool { return srv.Stats().Expired == 1 })
	if _, err := cl.Request(context.Background(), queue, "fresca", []byte(`{}`)); err != nil {
		t.Fatalf("a fresh request: %v", err)
	}
	if _, ok := ran.Load("caducada"); ok {
		t.Fatal("the handler ran for the expired request")
	}
	if n := amqptest.QueueLen(t, conn, replyQueue); n != 0 {
		t.Fatalf("%d replies to the expired request", n)
	}
	if n := amqptest.QueueLen(t, conn, queue); n != 0 {
		t.Fatalf("%d requests left in the queue: the expired one was not acked", n)
	}
}

// The client sends its deadline twice: no_despres (unix seconds) and the AMQP
// expiration (milliseconds left), so that RabbitMQ drops a request still
// queued when its requester has given up.
func TestClientSendsItsDeadlineAsHeaderAndExpiration(t *testing.T) {
	t.Parallel()
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.rr.espiat")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue} })
	if err := conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		_, err := ch.QueueDeclare(queue, false, false, false, false, nil)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	cl, err := amqprr.NewClient(context.Background(), amqprr.ClientConfig{Conn: conn})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	before := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	go func() { _, _ = cl.Request(ctx, queue, "espiada", []byte(`{}`)) }()
	var d amqp091.Delivery
	testkit.Eventually(t, 10*time.Second, "the request in the queue", func() bool {
		var ok bool
		_ = conn.Do(context.Background(), func(ch *amqp091.Channel) error {
			d, ok, err = ch.Get(queue, true)
			return err
		})
		return ok
	})

	deadline, ok := amqprr.Deadline(&d)
	want, _ := ctx.Deadline()
	if !ok || deadline.Sub(want).Abs() > time.Millisecond {
		t.Fatalf("no_despres %v (%v), want %v", d.Headers[requestreply.HeaderDeadline], deadline, want)
	}
	ms, err := strconv.ParseInt(d.Expiration, 10, 64)
	if err != nil || ms <= 0 || ms > 3000 || time.Duration(ms)*time.Millisecond < want.Sub(before)-time.Second {
		t.Fatalf("expiration %q, want the milliseconds left of a 3 s timeout", d.Expiration)
	}
}

// Direct reply-to (amq.rabbitmq.reply-to, consumed no-ack, what most AMQP
// clients use): every request gets its reply, and the server counts every
// reply as replied, none as orphaned (RabbitMQ 3.10 returns a mandatory reply
// to a direct reply-to consumer although it delivered it).
func TestDirectReplyToClientGetsRepliesAndNoneIsOrphaned(t *testing.T) {
	t.Parallel()
	// The server's log says which reply came back (id_peticio).
	logs := &syncBuffer{}
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.rr")
	srv, err := amqprr.NewServer(context.Background(), amqprr.ServerConfig{Conn: conn, Queue: queue,
		Logger:  slog.New(slog.NewTextHandler(logs, nil)),
		Handler: func(_ context.Context, r *requestreply.Request) ([]byte, error) { return r.Body, nil }})
	if err != nil {
		t.Fatal(err)
	}
	amqptest.DeleteQueuesAtCleanup(t, srv.Queues)
	testkit.Background(t, "server", srv.Run)
	raw, err := amqp091.Dial(amqptest.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = raw.Close() })
	ch, err := raw.Channel()
	if err != nil {
		t.Fatal(err)
	}
	replies, err := ch.Consume(amqprr.DirectReplyTo, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 50
	for i := range n {
		if err := ch.PublishWithContext(context.Background(), "", queue, false, false, amqp091.Publishing{
			ReplyTo: amqprr.DirectReplyTo, CorrelationId: fmt.Sprintf("c-%d", i), MessageId: fmt.Sprintf("directa-%d", i),
			Body: []byte(strconv.Itoa(i))}); err != nil {
			t.Fatal(err)
		}
	}
	got := map[string]string{}
	timeout := time.After(20 * time.Second)
	for len(got) < n {
		select {
		case d := <-replies:
			got[d.CorrelationId] = string(d.Body)
		case <-timeout:
			t.Fatalf("%d of %d replies", len(got), n)
		}
	}
	for i := range n {
		if got[fmt.Sprintf("c-%d", i)] != strconv.Itoa(i) {
			t.Fatalf("reply to c-%d: %q", i, got[fmt.Sprintf("c-%d", i)])
		}
	}
	// Replies are not confirmed, so a return could still be on its way. A
	// last request whose reply_to names no queue is returned (mandatory) on
	// the same reply channel, after any return of the 50: once it is counted,
	// every return has been.
	if err := ch.PublishWithContext(context.Background(), "", queue, false, false, amqp091.Publishing{
		ReplyTo: amqptest.Name("t.rr.cap"), CorrelationId: "barrera", MessageId: "barrera", Body: []byte(`0`)}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the last reply returned", func() bool { return strings.Contains(logs.String(), "id_peticio=barrera") })
	if st := srv.Stats(); st.Replied != n+1 || st.Orphaned != 1 {
		t.Fatalf("stats %+v, want %d replied and only the last one orphaned", st, n+1)
	}
}

// syncBuffer is a bytes.Buffer safe for a logger and a reader at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}
