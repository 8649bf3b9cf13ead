package requestreply

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Reply is a reply as a transport received it, before decoding.
type Reply struct {
	Body      []byte
	Result    string // the resultat header
	Signature string // the HeaderSignature header ("" if unsigned)
	Err       error  // a transport failure instead of a reply
}

// Calls is the table of requests waiting for their replies, by correlation
// id, that a transport's requester keeps. It is safe for concurrent use.
// Each correlation id gets at most one reply: Deliver, and Receive when it
// delivers, remove it.
type Calls struct {
	verify  *ReplyVerifier
	mu      sync.Mutex
	pending map[string]*call
	closed  error
}

type call struct {
	ch      chan Reply
	id      string // request id
	replyTo string // the reply address the request named
}

// NewCalls returns an empty table whose replies from the wire (Receive) are
// checked by v (nil: every reply accepted).
func NewCalls(v *ReplyVerifier) *Calls { return &Calls{verify: v, pending: map[string]*call{}} }

// Add registers corr, the correlation id of request id whose replies go to
// replyTo, and returns the channel its reply will arrive on. After FailAll it
// returns FailAll's error instead.
func (c *Calls) Add(corr, id, replyTo string) (<-chan Reply, error) {
	ch := make(chan Reply, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed != nil {
		return nil, c.closed
	}
	c.pending[corr] = &call{ch: ch, id: id, replyTo: replyTo}
	return ch, nil
}

// Deliver hands r to the request waiting for corr, unchecked (a transport
// failure, or an unregistration), and reports whether one was waiting.
func (c *Calls) Deliver(corr string, r Reply) bool {
	c.mu.Lock()
	w, ok := c.pending[corr]
	delete(c.pending, corr)
	c.mu.Unlock()
	if ok {
		w.ch <- r // buffered 1, and corr is delivered at most once
	}
	return ok
}

// Received is what Receive did with a reply.
type Received int

// Values of Received.
const (
	// Delivered: handed to its waiting request.
	Delivered Received = iota
	// Late: no request waits for the correlation id (it timed out, or it
	// is unknown); the caller counts it.
	Late
	// Dropped: its signature is missing or wrong (see ReplyVerifier, which
	// counted it); the request keeps waiting.
	Dropped
)

// Receive hands a reply read from the wire to the request waiting for corr
// if the table's ReplyVerifier accepts it.
func (c *Calls) Receive(corr string, r Reply) Received {
	c.mu.Lock()
	w, ok := c.pending[corr]
	c.mu.Unlock()
	if !ok {
		return Late
	}
	if !c.verify.check(w.id, corr, w.replyTo, r) {
		return Dropped
	}
	c.mu.Lock()
	w2, ok := c.pending[corr]
	if ok && w2 == w {
		delete(c.pending, corr)
	}
	c.mu.Unlock()
	if !ok || w2 != w {
		return Late // timed out meanwhile
	}
	w.ch <- r
	return Delivered
}

// FailAll ends every waiting request with err, and makes later Adds fail
// with it.
func (c *Calls) FailAll(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = err
	for corr, w := range c.pending {
		w.ch <- Reply{Err: err}
		delete(c.pending, corr)
	}
}

// Await waits for corr's reply on wait until ctx ends, and decodes it. If ctx
// ends first, corr is unregistered, so that its reply, if it comes, is a late
// one; the error is a *TimeoutError when ctx's deadline passed (measured from
// start), else ctx.Err().
func (c *Calls) Await(ctx context.Context, service, requestID, corr string, start time.Time, wait <-chan Reply) ([]byte, error) {
	select {
	case r := <-wait:
		return r.decode(service)
	case <-ctx.Done():
		if c.Deliver(corr, Reply{}) {
			return nil, CtxError(ctx, service, requestID, start)
		}
		return (<-wait).decode(service) // the reply won the race
	}
}

func (r Reply) decode(service string) ([]byte, error) {
	if r.Err != nil {
		return nil, r.Err
	}
	return DecodeReply(service, r.Result, r.Body)
}

// CtxError is the error of a request whose ctx ended: a *TimeoutError for a
// deadline (measured from start), else ctx.Err().
func CtxError(ctx context.Context, service, requestID string, start time.Time) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return &TimeoutError{Service: service, RequestID: requestID, After: time.Since(start)}
	}
	return ctx.Err()
}

// WithTimeout returns ctx with timeout as deadline when it has none.
func WithTimeout(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, timeout)
}
