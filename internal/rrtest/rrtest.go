// Package rrtest is the conformance suite every request/reply transport runs
// (like Watermill's pubsub tests): the same proofs, against the real broker
// and PostgreSQL, for requestreply/amqprr and requestreply/kafkarr.
package rrtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/requestreply"
)

// Started is a running server and a requester that reaches it.
type Started struct {
	Requester requestreply.Requester
	Service   string       // the name to pass to Request
	Late      func() int64 // the requester's count of late replies
	// StopServer stops the running server and waits until it has stopped
	// (its queue or topic, and the requester, stay).
	StopServer func()
	// StartServer starts a new server on the same queue or topic, running h,
	// as a process restart would; it stops at the test's cleanup.
	StartServer func(h requestreply.Handler)
}

// Transport starts a server that runs h and a requester for it; both stop
// at the test's cleanup.
type Transport func(t *testing.T, h requestreply.Handler) Started

// Run runs every proof as a subtest.
func Run(t *testing.T, start Transport) {
	t.Run("ManyConcurrentRequestsAreMatched", func(t *testing.T) { manyConcurrent(t, start) })
	t.Run("SlowServerTimesOutAndLateReplyIsDropped", func(t *testing.T) { slowServer(t, start) })
	t.Run("SameRequestIDRunsTheEffectOnce", func(t *testing.T) { idempotent(t, start) })
	t.Run("BadRequestGetsAnErrorReply", func(t *testing.T) { badRequest(t, start) })
	t.Run("RestartWithAnExpiredBacklogAnswersFreshRequests", func(t *testing.T) { expiredBacklog(t, start) })
	t.Run("SlowRequestDoesNotHoldBackFreshOnes", func(t *testing.T) { slowDoesNotBlock(t, start) })
	t.Run("OversizedRequestIsRefusedWithoutRunningTheHandler", func(t *testing.T) { oversized(t, start) })
}

type echoReq struct {
	N    int    `json:"n"`
	Word string `json:"paraula"`
}

type echoResp struct {
	N     int    `json:"n"`
	Upper string `json:"majuscules"`
}

func echo(_ context.Context, req *requestreply.Request) ([]byte, error) {
	var in echoReq
	if err := requestreply.DecodeJSON(req.Body, &in); err != nil {
		return nil, err
	}
	return json.Marshal(echoResp{N: in.N * 2, Upper: strings.ToUpper(in.Word)})
}

// 1,000 concurrent requests from 50 goroutines get 1,000 replies,
// each the answer to its own request.
func manyConcurrent(t *testing.T, start Transport) {
	s := start(t, echo)
	const goroutines, each = 50, 20
	var ok atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, goroutines*each)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				n := g*each + i
				word := fmt.Sprintf("mot-%d", n)
				body, _ := json.Marshal(echoReq{N: n, Word: word})
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				resp, err := s.Requester.Request(ctx, s.Service, fmt.Sprintf("req-%d", n), body)
				cancel()
				if err != nil {
					errs <- fmt.Errorf("request %d: %w", n, err)
					continue
				}
				var out echoResp
				if err := json.Unmarshal(resp, &out); err != nil || out.N != 2*n || out.Upper != strings.ToUpper(word) {
					errs <- fmt.Errorf("request %d got the reply %s", n, resp)
					continue
				}
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if ok.Load() != goroutines*each {
		t.Fatalf("%d of %d requests got their own reply", ok.Load(), goroutines*each)
	}
	if s.Late() != 0 {
		t.Fatalf("%d late replies with no timeout", s.Late())
	}
}

// A server slower than the deadline gives a typed timeout; its reply,
// arriving later, is dropped and counted, and is not delivered to the next
// request, which gets its own reply.
func slowServer(t *testing.T, start Transport) {
	release := make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	// The request's deadline passes once the server holds the request, not
	// after a fixed time: on a loaded machine a request can take longer than
	// any short timeout to arrive, and the server drops an expired one unread.
	ctx := &deadlineOnSignal{Context: context.Background(), done: make(chan struct{})}
	s := start(t, func(_ context.Context, req *requestreply.Request) ([]byte, error) {
		if string(req.Body) == `{"lent":true}` {
			ctx.pass()
			<-release
		}
		return []byte(`{"resposta":` + string(req.Body) + `}`), nil
	})
	_, err := s.Requester.Request(ctx, s.Service, "lenta-1", []byte(`{"lent":true}`))
	var te *requestreply.TimeoutError
	if !errors.As(err, &te) || !errors.Is(err, requestreply.ErrTimeout) || te.RequestID != "lenta-1" {
		t.Fatalf("want a *TimeoutError for lenta-1, got %v", err)
	}
	free() // the server answers now, after the deadline
	testkit.Eventually(t, 20*time.Second, "the late reply to be counted", func() bool { return s.Late() == 1 })
	resp, err := s.Requester.Request(context.Background(), s.Service, "rapida-1", []byte(`{"lent":false}`))
	if err != nil || string(resp) != `{"resposta":{"lent":false}}` {
		t.Fatalf("the next request got %s, %v; want its own reply", resp, err)
	}
	if s.Late() != 1 {
		t.Fatalf("late replies %d, want 1", s.Late())
	}
}

// The same request id, sent twice (one after the other, then twice at
// once), runs the effect once and gets the same response every time.
func idempotent(t *testing.T, start Transport) {
	db := pgtest.NewSchema(t)
	ctx := context.Background()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox, requestreply.Migrations); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE autoritzacions (n SERIAL PRIMARY KEY, comanda_id TEXT NOT NULL, import_centims INT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	type authReq struct {
		OrderID string `json:"comanda_id"`
		Amount  int    `json:"import_centims"`
	}
	h := requestreply.Idempotent(db.Pool, db.Names(), "pagaments.autoritzacio", func(ctx context.Context, tx pgx.Tx, req *requestreply.Request) ([]byte, error) {
		var in authReq
		if err := requestreply.DecodeJSON(req.Body, &in); err != nil {
			return nil, err
		}
		var n int
		if err := tx.QueryRow(ctx, `INSERT INTO autoritzacions (comanda_id, import_centims) VALUES ($1, $2) RETURNING n`, in.OrderID, in.Amount).Scan(&n); err != nil {
			return nil, err
		}
		return json.Marshal(map[string]any{"autoritzacio": fmt.Sprintf("AUT-%d", n), "comanda_id": in.OrderID})
	})
	s := start(t, h)
	body := []byte(`{"comanda_id":"P-2026-000123","import_centims":4250}`)
	first, err := s.Requester.Request(ctx, s.Service, "autoritzacio-P-2026-000123", body)
	if err != nil {
		t.Fatal(err)
	}
	second, err := s.Requester.Request(ctx, s.Service, "autoritzacio-P-2026-000123", body)
	if err != nil || string(second) != string(first) {
		t.Fatalf("repeat got %s, %v; want the stored %s", second, err, first)
	}
	// Two at once, with a new id.
	var wg sync.WaitGroup
	got := make([]string, 2)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, err := s.Requester.Request(ctx, s.Service, "autoritzacio-P-2026-000124", []byte(`{"comanda_id":"P-2026-000124","import_centims":990}`))
			if err != nil {
				t.Error(err)
			}
			got[i] = string(b)
		}()
	}
	wg.Wait()
	if got[0] != got[1] || got[0] == "" {
		t.Fatalf("concurrent repeats got %q and %q", got[0], got[1])
	}
	var effects int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM autoritzacions`).Scan(&effects); err != nil {
		t.Fatal(err)
	}
	if effects != 2 {
		t.Fatalf("%d effects for 2 request ids sent 4 times, want 2", effects)
	}
}

// Bad requests (malformed JSON, no id for an idempotent server) get an error
// reply with a clear, non-retryable message, never a timeout.
func badRequest(t *testing.T, start Transport) {
	s := start(t, echo)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := s.Requester.Request(ctx, s.Service, "dolenta-1", []byte(`{"n": 1, "paraula": `))
	var re *requestreply.RemoteError
	if !errors.As(err, &re) || !errors.Is(err, requestreply.ErrRemote) || re.Retryable ||
		!strings.Contains(re.Message, "bad request: malformed JSON") {
		t.Fatalf("want a non-retryable error reply about malformed JSON, got %v", err)
	}
}

// A request body longer than the server's bound
// (requestreply.MaxBodyBytesDefault, the servers' default) gets a
// non-retryable error reply naming the limit, and the handler never runs; a
// body of exactly the bound is handled.
func oversized(t *testing.T, start Transport) {
	var calls atomic.Int64
	s := start(t, func(context.Context, *requestreply.Request) ([]byte, error) {
		calls.Add(1)
		return []byte(`{}`), nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	big := []byte(strings.Repeat("a", requestreply.MaxBodyBytesDefault+1))
	_, err := s.Requester.Request(ctx, s.Service, "gran-1", big)
	var re *requestreply.RemoteError
	if !errors.As(err, &re) || re.Retryable || !strings.Contains(re.Message, "over the limit") {
		t.Fatalf("want a non-retryable error reply about the size, got %v", err)
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("the handler ran %d times for an oversized request", n)
	}
	if _, err := s.Requester.Request(ctx, s.Service, "gran-2", big[:requestreply.MaxBodyBytesDefault]); err != nil {
		t.Fatalf("a body at the bound: %v", err)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
}

// Stoppable runs run (a server's Run) and returns the function that cancels
// it and waits for it to return (failing the test if it returned an error).
// Calling that function more than once is harmless.
func Stoppable(t *testing.T, run func(ctx context.Context) error) (stop func()) {
	t.Helper()
	r := testkit.Start(t, "server", run)
	return sync.OnceFunc(func() {
		if err := r.Stop(); err != nil {
			t.Errorf("server: %v", err)
		}
	})
}

// deadlineOnSignal is a context whose deadline (a minute away, as the server
// sees it) passes when pass is called: Done closes and Err is
// context.DeadlineExceeded.
type deadlineOnSignal struct {
	context.Context
	once sync.Once
	done chan struct{}
}

func (c *deadlineOnSignal) Deadline() (time.Time, bool) { return time.Now().Add(time.Minute), true }
func (c *deadlineOnSignal) Done() <-chan struct{}       { return c.done }
func (c *deadlineOnSignal) pass()                       { c.once.Do(func() { close(c.done) }) }
func (c *deadlineOnSignal) Err() error {
	select {
	case <-c.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}
