package kafkarr_test

import (
	"context"
	"fmt"
	"sync"
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
)

func rawRequest(t *testing.T, pub *kgo.Client, id, replyTo string, deadline time.Time) {
	t.Helper()
	if err := pub.ProduceSync(context.Background(), &kgo.Record{Topic: kafkarr.TopicDefault, Key: []byte(id), Value: []byte(`{}`), Headers: []kgo.RecordHeader{
		{Key: contract.HeaderCorrelator, Value: []byte("c-" + id)}, {Key: kafkarr.HeaderReplyTo, Value: []byte(replyTo)},
		{Key: kafkarr.HeaderRequestID, Value: []byte(id)},
		{Key: requestreply.HeaderDeadline, Value: []byte(requestreply.FormatDeadline(deadline))}}}).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// A request read after its no_despres is dropped and counted; its handler
// never runs; a fresh request is answered.
func TestExpiredRequestIsDroppedWithoutRunningTheHandler(t *testing.T) {
	t.Parallel()
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
	testkit.Background(t, "server", srv.Run)
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	rawRequest(t, kafkatest.Client(t, b), "caducada", cl.ReplyTopic(), time.Now().Add(-time.Second))
	testkit.Eventually(t, 20*time.Second, "the expired request counted", func() bool { return srv.Stats().Expired == 1 })
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
	t.Parallel()
	b := kafkatest.New(t)
	ctx := context.Background()
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Workers: 1,
		Handler: func(_ context.Context, r *requestreply.Request) ([]byte, error) { return r.Body, nil }})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Background(t, "server", srv.Run)
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
	testkit.Eventually(t, 20*time.Second, "the undeliverable reply counted", func() bool { return srv.Stats().Unanswerable == 1 })
	testkit.Eventually(t, 20*time.Second, "4 replies counted", func() bool { return srv.Stats().Replied == 4 })
}

// Servers joining and leaving the group while requests flow: every request
// is answered. A server that gives up partitions (one joins: revoked; it
// stops: all) commits only what it finished, so the requests it had queued
// go to the member that takes the partitions.
func TestRequestsAreAnsweredWhileServersJoinAndLeave(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t)
	ctx := context.Background()
	var ran sync.Map
	h := func(_ context.Context, r *requestreply.Request) ([]byte, error) {
		ran.Store(r.ID, true)
		return r.Body, nil
	}
	serve := func() (*kafkarr.Server, func()) {
		srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: h, Workers: 1, MaxInFlight: 16})
		if err != nil {
			t.Fatal(err)
		}
		stop := rrtest.Stoppable(t, srv.Run)
		t.Cleanup(stop)
		return srv, stop
	}
	_, stopA := serve()
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	const callers = 8
	var wg sync.WaitGroup
	var sent, answered atomic.Int64
	enough := make(chan struct{})
	errs := make(chan error, 1000)
	for g := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-enough:
					return
				default:
				}
				id := fmt.Sprintf("r-%d-%d", g, i)
				sent.Add(1)
				rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				resp, err := cl.Request(rctx, kafkarr.TopicDefault, id, []byte(id))
				cancel()
				if err != nil || string(resp) != id {
					_, handled := ran.Load(id)
					errs <- fmt.Errorf("%s: %q, %v (handled: %v)", id, resp, err, handled)
					continue
				}
				answered.Add(1)
			}
		}()
	}
	servedSome := func(srv *kafkarr.Server, what string) {
		t.Helper()
		testkit.Eventually(t, 60*time.Second, what, func() bool { return srv.Stats().Replied > 100 })
	}
	srvB, stopB := serve() // joins: A gives up some partitions
	servedSome(srvB, "the second server to answer")
	stopA() // leaves: B takes them all
	srvC, _ := serve()
	servedSome(srvC, "the third server to answer")
	stopB()
	before := answered.Load()
	testkit.Eventually(t, 60*time.Second, "more answers after the last change", func() bool { return answered.Load() > before+100 })
	close(enough)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if answered.Load() != sent.Load() {
		t.Fatalf("%d of %d requests answered", answered.Load(), sent.Load())
	}
}

// A server that stops with requests taken but not started (its one worker
// busy) does not commit past them: the next server answers them.
func TestRequestsQueuedAtStopAreAnsweredByTheNextServer(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t)
	ctx := context.Background()
	inside := make(chan struct{}, 1)
	var blocked atomic.Bool
	h := func(ctx context.Context, r *requestreply.Request) ([]byte, error) {
		if string(r.Body) == "bloc" && blocked.CompareAndSwap(false, true) {
			inside <- struct{}{}
			<-ctx.Done() // holds the only worker until the server stops
			return nil, ctx.Err()
		}
		return r.Body, nil
	}
	// One partition, so that every request queues behind the blocking one.
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: h, Workers: 1, MaxInFlight: 16, Partitions: 1, Topic: "t.una"})
	if err != nil {
		t.Fatal(err)
	}
	stop := rrtest.Stoppable(t, srv.Run)
	t.Cleanup(stop)
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	blocResult := make(chan error, 1)
	go func() {
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		_, err := cl.Request(rctx, "t.una", "bloc", []byte("bloc"))
		blocResult <- err
	}()
	<-inside
	const queued = 5
	results := make(chan error, queued)
	for i := range queued {
		go func() {
			id := fmt.Sprintf("cua-%d", i)
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			resp, err := cl.Request(rctx, "t.una", id, []byte(id))
			if err == nil && string(resp) != id {
				err = fmt.Errorf("%s got %q", id, resp)
			}
			results <- err
		}()
	}
	testkit.Eventually(t, 20*time.Second, "the requests taken behind the busy worker", func() bool { return kafkarr.InHand(srv) == queued+1 })
	stop()
	next, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: h, Workers: 1, MaxInFlight: 16, Partitions: 1, Topic: "t.una"})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Background(t, "server", next.Run)
	for range queued {
		if err := <-results; err != nil {
			t.Error(err)
		}
	}
	// The request whose handler the stop cut short got no error reply: the
	// next server answered it.
	if err := <-blocResult; err != nil {
		t.Errorf("the request cut short by the stop: %v", err)
	}
}
