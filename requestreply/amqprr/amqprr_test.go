package amqprr_test

import (
	"context"
	"errors"
	"strings"
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

// start runs a server on a unique queue and returns it with a client.
func start(t *testing.T, h requestreply.Handler) (*amqprr.Server, *amqprr.Client, string) {
	t.Helper()
	conn := amqptest.Dial(t)
	queue := amqptest.Name("t.rr")
	ctx := context.Background()
	srv, err := amqprr.NewServer(ctx, amqprr.ServerConfig{Conn: conn, Queue: queue, Handler: h})
	if err != nil {
		t.Fatal(err)
	}
	amqptest.DeleteQueuesAtCleanup(t, srv.Queues)
	testkit.Background(t, "server", srv.Run)
	cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: conn})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	return srv, cl, queue
}

// The proofs of rrtest over RabbitMQ, with the client's exclusive reply
// queue and with direct reply-to, and over a connection with coalesced
// writes (amqp.Config.CoalesceWrites, as the system's).
func TestConformance(t *testing.T) {
	t.Parallel()
	t.Run("ExclusiveQueue", func(t *testing.T) { conformance(t, false, false) })
	t.Run("DirectReplyTo", func(t *testing.T) { conformance(t, true, false) })
	t.Run("CoalescedWrites", func(t *testing.T) { conformance(t, false, true) })
}

// dialCoalesced is amqptest.Dial with CoalesceWrites.
func dialCoalesced(t *testing.T) *amqp.Conn {
	t.Helper()
	amqptest.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := amqp.Dial(ctx, amqp.Config{URL: amqptest.URL(), Name: "km0-test " + t.Name(), ReconnectMax: time.Second, CoalesceWrites: true})
	if err != nil {
		t.Fatalf("RabbitMQ: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func conformance(t *testing.T, direct, coalesced bool) {
	rrtest.Run(t, func(t *testing.T, h requestreply.Handler) rrtest.Started {
		conn := amqptest.Dial(t)
		if coalesced {
			conn = dialCoalesced(t)
		}
		queue := amqptest.Name("t.rr")
		ctx := context.Background()
		serve := func(h requestreply.Handler) func() {
			srv, err := amqprr.NewServer(ctx, amqprr.ServerConfig{Conn: conn, Queue: queue, Handler: h})
			if err != nil {
				t.Fatal(err)
			}
			stop := rrtest.Stoppable(t, srv.Run)
			t.Cleanup(stop)
			return stop
		}
		stop := serve(h)
		amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue, contract.DLQName(queue)} })
		cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: conn, DirectReplyTo: direct})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cl.Close() })
		return rrtest.Started{Requester: cl, Service: queue, Late: cl.LateReplies,
			StopServer: func() { stop() }, StartServer: func(h requestreply.Handler) { stop = serve(h) }}
	})
}

func TestRequestToAMissingQueueFailsAtOnceWithErrNoService(t *testing.T) {
	t.Parallel()
	_, cl, queue := start(t, func(context.Context, *requestreply.Request) ([]byte, error) { return nil, nil })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cl.Request(ctx, queue+".ningu", "x", []byte(`{}`)); !errors.Is(err, requestreply.ErrNoService) {
		t.Fatalf("want ErrNoService, got %v", err)
	}
}

func TestRequestWithoutReplyToIsDeadLettered(t *testing.T) {
	t.Parallel()
	srv, _, queue := start(t, func(context.Context, *requestreply.Request) ([]byte, error) { return []byte(`{}`), nil })
	conn := amqptest.Dial(t)
	pub, err := amqp.NewPublisher(context.Background(), conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.PublishRaw(context.Background(), "", queue, amqp091.Publishing{Body: []byte(`{}`), MessageId: "sense-resposta"}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the request without reply_to in the DLQ", func() bool {
		return amqptest.DLQLen(t, conn, queue) == 1
	})

	if st := srv.Stats(); st.DeadLettered != 1 || st.Replied != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestReplyToAGoneClientIsCountedAsOrphaned(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	srv, _, queue := start(t, func(context.Context, *requestreply.Request) ([]byte, error) {
		<-release
		return []byte(`{}`), nil
	})
	conn := amqptest.Dial(t)
	cl, err := amqprr.NewClient(context.Background(), amqprr.ClientConfig{Conn: conn})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	_, err = cl.Request(ctx, queue, "orfe-1", []byte(`{}`))
	cancel()
	if !errors.Is(err, requestreply.ErrTimeout) {
		t.Fatalf("want a timeout, got %v", err)
	}
	_ = cl.Close() // its exclusive reply queue goes with its channel
	close(release)
	testkit.Eventually(t, 10*time.Second, "the returned reply counted as orphaned", func() bool { return srv.Stats().Orphaned == 1 })
}

// A request id or service name AMQP cannot carry (a shortstr: at most 255
// bytes) is the caller's error alone: it must not take the connection, and
// the other requests waiting on it, down with it.
func TestOverlongRequestIDOrServiceFailsAloneWithAClearError(t *testing.T) {
	t.Parallel()
	inside, release := make(chan struct{}), make(chan struct{})
	_, cl, queue := start(t, func(_ context.Context, req *requestreply.Request) ([]byte, error) {
		if req.ID == "lenta" {
			close(inside)
			<-release
		}
		return []byte(`{"ok":true}`), nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	slow := make(chan error, 1)
	go func() {
		_, err := cl.Request(ctx, queue, "lenta", []byte(`{}`))
		slow <- err
	}()
	<-inside
	for _, c := range []struct{ service, id string }{
		{queue, strings.Repeat("x", 256)},
		{queue + strings.Repeat(".x", 128), "curta"},
	} {
		_, err := cl.Request(ctx, c.service, c.id, []byte(`{}`))
		if err == nil || errors.Is(err, requestreply.ErrConnectionLost) || !strings.Contains(err.Error(), "255") {
			t.Fatalf("service of %d bytes, id of %d bytes: want an error naming the 255-byte limit, got %v", len(c.service), len(c.id), err)
		}
	}
	close(release)
	if err := <-slow; err != nil {
		t.Fatalf("the request waiting meanwhile: %v", err)
	}
	if _, err := cl.Request(ctx, queue, "despres", []byte(`{}`)); err != nil {
		t.Fatalf("a request after: %v", err)
	}
}

// A deadline that passes while the request is being published is a timeout
// like one that passes while waiting for the reply: the caller asks again
// with the same request id on errors.Is(err, requestreply.ErrTimeout).
func TestDeadlinePassedWhilePublishingIsATimeout(t *testing.T) {
	_, cl, queue := start(t, func(_ context.Context, req *requestreply.Request) ([]byte, error) { return req.Body, nil })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cl.Request(ctx, queue, "primera", []byte(`{}`)); err != nil { // the session is open
		t.Fatal(err)
	}
	past, cancelPast := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancelPast()
	_, err := cl.Request(past, queue, "tard", []byte(`{}`))
	if !errors.Is(err, requestreply.ErrTimeout) {
		t.Fatalf("a request whose deadline passed before its publish: want ErrTimeout, got %v", err)
	}
}
