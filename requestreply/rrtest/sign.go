package rrtest

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/km0/km0/requestreply"
)

// SignedTransport starts a server on a fresh queue or topic running h and
// returns a function that makes requesters for it, each signing with key
// (nil: unsigned), and the name to pass to Request. Everything stops at the
// test's cleanup.
type SignedTransport func(t *testing.T, h requestreply.Handler) (requester func(key []byte) requestreply.Requester, service string)

// RunSigning proves a server guarded by a requestreply.Verifier: a request
// signed with the shared key is answered; an unsigned one and one signed with
// another key get the non-retryable error reply ErrUnauthenticated, are
// counted, and never run the handler.
func RunSigning(t *testing.T, start SignedTransport) {
	key := []byte("clau-compartida-de-prova")
	var ran atomic.Int64
	var verifier atomic.Pointer[requestreply.Verifier] // set once the service's name is known, before any request
	h := func(ctx context.Context, req *requestreply.Request) ([]byte, error) {
		ran.Add(1)
		return []byte(`{"ok":true}`), nil
	}
	newRequester, service := start(t, func(ctx context.Context, req *requestreply.Request) ([]byte, error) {
		return verifier.Load().Wrap(h)(ctx, req)
	})
	v, err := requestreply.NewVerifier(requestreply.VerifierConfig{Key: key, Queue: service, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	verifier.Store(v)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if out, err := newRequester(key).Request(ctx, service, "signada-1", []byte(`{"n":1}`)); err != nil || string(out) != `{"ok":true}` {
		t.Fatalf("signed request: %s, %v", out, err)
	}
	for i, k := range [][]byte{nil, []byte("una-altra-clau")} {
		_, err := newRequester(k).Request(ctx, service, "falsa-"+string(rune('1'+i)), []byte(`{"n":1}`))
		var re *requestreply.RemoteError
		if !errors.As(err, &re) || re.Retryable || re.Message != requestreply.ErrUnauthenticated.Error() {
			t.Fatalf("request %d (key %q): want the non-retryable ErrUnauthenticated reply, got %v", i, k, err)
		}
	}
	if got := ran.Load(); got != 1 {
		t.Fatalf("the handler ran %d times, want 1 (the signed request only)", got)
	}
	if got := v.Refused(); got != 2 {
		t.Fatalf("Refused() = %d, want 2", got)
	}
}
