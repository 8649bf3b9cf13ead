package rrtest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply"
)

// Keys of the signing proofs: the deployment's, and an attacker's of the
// same length.
var (
	KeyShared = []byte("clau-compartida-de-prova-32-bytes")
	KeyOther  = []byte("una-altra-clau-de-32-bytes-potser")
)

// Signed is a server with a signing key, started by a SignedTransport.
type Signed struct {
	// Requester returns a new requester for Service that signs with key
	// (nil: unsigned and accepting any reply), its count of replies
	// dropped for their signature and its count of late replies (whose
	// request had ended: those are not verified).
	Requester func(key []byte) (r requestreply.Requester, dropped, late func() int64)
	Service   string
	// Refused is the server's count of requests refused as unauthenticated.
	Refused func() int64
	// Rogue starts a replier that competes with the server for its
	// requests as anyone allowed to consume them could (a competing consumer
	// of the RabbitMQ queue; a reader of the Kafka topic in a group of its
	// own) and answers each with ok and body, signed with key as a server
	// would (nil: unsigned). It returns how many replies it wrote. It stops
	// at the test's cleanup.
	Rogue func(key, body []byte) (answered func() int64)
}

// SignedTransport starts a server on a fresh queue or topic running h with
// ServerConfig.SigningKey key; everything stops at the test's cleanup.
type SignedTransport func(t *testing.T, h requestreply.Handler, key []byte) Signed

// RunSigning runs the signing proofs as subtests.
func RunSigning(t *testing.T, start SignedTransport) {
	t.Run("OnlySignedRequestsAreServed", func(t *testing.T) { signedOnly(t, start) })
	t.Run("RogueRepliesAreDropped", func(t *testing.T) { rogueReplies(t, start) })
}

// A request signed with the shared key is answered; an unsigned one gets
// the non-retryable error reply ErrUnauthenticated; one signed with another
// key is refused too, and its requester drops the server's reply (signed
// with a key it does not share) and times out. Neither runs the handler.
func signedOnly(t *testing.T, start SignedTransport) {
	var ran atomic.Int64
	s := start(t, func(ctx context.Context, req *requestreply.Request) ([]byte, error) {
		ran.Add(1)
		return []byte(`{"ok":true}`), nil
	}, KeyShared)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	good, _, _ := s.Requester(KeyShared)
	if out, err := good.Request(ctx, s.Service, "signada-1", []byte(`{"n":1}`)); err != nil || string(out) != `{"ok":true}` {
		t.Fatalf("signed request: %s, %v", out, err)
	}
	unsigned, _, _ := s.Requester(nil)
	_, err := unsigned.Request(ctx, s.Service, "falsa-1", []byte(`{"n":1}`))
	var re *requestreply.RemoteError
	if !errors.As(err, &re) || re.Retryable || re.Message != requestreply.ErrUnauthenticated.Error() {
		t.Fatalf("unsigned request: want the non-retryable ErrUnauthenticated reply, got %v", err)
	}
	other, dropped, _ := s.Requester(KeyOther)
	octx, ocancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer ocancel()
	if out, err := other.Request(octx, s.Service, "falsa-2", []byte(`{"n":1}`)); !errors.Is(err, requestreply.ErrTimeout) {
		t.Fatalf("request signed with another key: want a timeout (the server's reply is not signed with that key), got %s, %v", out, err)
	}
	if got := dropped(); got != 1 {
		t.Fatalf("the requester with another key dropped %d replies, want 1", got)
	}
	if got := ran.Load(); got != 1 {
		t.Fatalf("the handler ran %d times, want 1 (the signed request only)", got)
	}
	if got := s.Refused(); got != 2 {
		t.Fatalf("the server refused %d requests, want 2", got)
	}
}

// Two rogues compete with the server for its requests and answer approved at
// once, one unsigned and one signed with another key. A requester with the
// shared key takes none of their replies: each is dropped and counted, and
// each request gets the server's reply (over Kafka the server sees every
// request too) or, when a rogue took it from the queue, times out.
func rogueReplies(t *testing.T, start SignedTransport) {
	genuine := []byte(`{"aprovada":false,"motiu":"import_excessiu"}`)
	forged := []byte(`{"aprovada":true}`)
	var ran atomic.Int64
	s := start(t, func(ctx context.Context, req *requestreply.Request) ([]byte, error) {
		ran.Add(1)
		// A server slower than the rogues: over Kafka, where both see every
		// request, the rogues' replies come first.
		select {
		case <-time.After(300 * time.Millisecond):
		case <-ctx.Done():
		}
		return genuine, nil
	}, KeyShared)
	unsignedRogue := s.Rogue(nil, forged)
	otherRogue := s.Rogue(KeyOther, forged)
	req, dropped, late := s.Requester(KeyShared)
	const n = 12
	var wg sync.WaitGroup
	var replied, timedOut atomic.Int64
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			out, err := req.Request(ctx, s.Service, fmt.Sprintf("autoritzacio-%d", i), []byte(`{"comanda_id":"c","import_centims":900000}`))
			switch {
			case err == nil && string(out) == string(genuine):
				replied.Add(1)
			case errors.Is(err, requestreply.ErrTimeout):
				timedOut.Add(1)
			default:
				errs <- fmt.Errorf("request %d: %s, %v (want the server's reply or a timeout)", i, out, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	answered := func() int64 { return unsignedRogue() + otherRogue() }
	if answered() == 0 {
		t.Fatal("no rogue answered: the proof proves nothing")
	}
	// Each rogue reply is dropped for its signature while its request
	// waits, or, when it comes after the request ended (the server's reply
	// came first, or the request timed out), dropped as late; a rogue's
	// reply may still be on its way when the last request returned. Late
	// replies also count the server's own replies to timed-out requests.
	testkit.Eventually(t, 10*time.Second, "every rogue reply dropped or late", func() bool { return dropped()+late() >= answered() })
	if got, want := dropped(), answered(); got == 0 || got > want {
		t.Fatalf("dropped %d replies for their signature, want between 1 and the %d the rogues wrote", got, want)
	}
	if replied.Load()+timedOut.Load() != n || replied.Load() != ran.Load() {
		t.Fatalf("%d server replies taken, %d timeouts, handler ran %d times: want replies = handler runs, replies + timeouts = %d",
			replied.Load(), timedOut.Load(), ran.Load(), n)
	}
}
