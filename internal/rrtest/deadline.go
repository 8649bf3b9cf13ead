package rrtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/km0/km0/requestreply"
)

// Restart proof: requests sent while no server runs, whose requesters timed
// out long before a server starts, are a backlog of stale work. The restarted
// server must drop them without running the handler (their requesters will
// retry with the same id if they still care), so that the fresh requests
// behind them are answered within their own timeout.
func expiredBacklog(t *testing.T, start Transport) {
	var stale, fresh atomic.Int64
	// Each request costs the handler 50 ms: the stale backlog, were it run,
	// would take (backlog × 50 ms / workers) ≈ 3 s, longer than a fresh
	// request's timeout.
	h := func(ctx context.Context, req *requestreply.Request) ([]byte, error) {
		if strings.HasPrefix(req.ID, "vella-") {
			stale.Add(1)
		} else {
			fresh.Add(1)
		}
		select {
		case <-time.After(50 * time.Millisecond): // the handler's own work, not a wait for the test
		case <-ctx.Done():
		}
		return req.Body, nil
	}
	s := start(t, h)
	ctx := context.Background()
	if _, err := s.Requester.Request(ctx, s.Service, "primera", []byte(`{"n":0}`)); err != nil {
		t.Fatalf("before the restart: %v", err)
	}
	s.StopServer()

	const backlog = 1000
	var wg sync.WaitGroup
	var timedOut atomic.Int64
	for i := range backlog {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
			_, err := s.Requester.Request(rctx, s.Service, fmt.Sprintf("vella-%d", i), []byte(`{"vella":true}`))
			if errors.Is(err, requestreply.ErrTimeout) {
				timedOut.Add(1)
			}
		}()
	}
	wg.Wait() // every stale request's requester has given up: its deadline is past
	if timedOut.Load() != backlog {
		t.Fatalf("%d of %d requests without a server timed out", timedOut.Load(), backlog)
	}

	s.StartServer(h)
	const callers = 8
	errs := make(chan error, callers)
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			body := fmt.Sprintf(`{"n":%d}`, i)
			resp, err := s.Requester.Request(rctx, s.Service, fmt.Sprintf("nova-%d", i), []byte(body))
			if err == nil && string(resp) != body {
				err = fmt.Errorf("reply %s", resp)
			}
			if err != nil {
				errs <- fmt.Errorf("fresh request %d after the restart: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := stale.Load(); n != 0 {
		t.Fatalf("the handler ran for %d expired requests, want 0", n)
	}
	if n := fresh.Load(); n < callers+1 {
		t.Fatalf("the handler ran for %d fresh requests, want at least %d", n, callers+1)
	}
}

// A request that takes long holds one worker, not the server: requests that
// arrive after it are answered meanwhile.
func slowDoesNotBlock(t *testing.T, start Transport) {
	inside, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	s := start(t, func(_ context.Context, req *requestreply.Request) ([]byte, error) {
		if req.ID == "lenta" {
			close(inside)
			<-release
		}
		return req.Body, nil
	})
	defer free() // before the cleanups, which stop the server
	ctx := context.Background()
	slow := make(chan error, 1)
	go func() {
		rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		_, err := s.Requester.Request(rctx, s.Service, "lenta", []byte(`{}`))
		slow <- err
	}()
	<-inside
	for i := range 10 {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		body := fmt.Sprintf(`{"n":%d}`, i)
		resp, err := s.Requester.Request(rctx, s.Service, fmt.Sprintf("rapida-%d", i), []byte(body))
		cancel()
		if err != nil || string(resp) != body {
			t.Fatalf("request %d while a slow one runs: %q, %v", i, resp, err)
		}
	}
	free()
	if err := <-slow; err != nil {
		t.Fatalf("the slow request: %v", err)
	}
}
