package requestreply

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Reply is a reply as a transport received it, before decoding.
type Reply struct {
	Body   []byte
	Result string // the resultat header
	Err    error  // a transport failure instead of a reply
}

// Calls is the table of requests waiting for their replies, by correlation
// id, that a transport's requester keeps. It is safe for concurrent use.
// Each correlation id gets at most one reply: Deliver removes it.
type Calls struct {
	mu      sync.Mutex
	pending map[string]chan Reply
	closed  error
}

// NewCalls returns an empty table.
func NewCalls() *Calls { return &Calls{pending: map[string]chan Reply{}} }

// Add registers corr and returns the channel its reply will arrive on. After
// FailAll it returns FailAll's error instead.
func (c *Calls) Add(corr string) (<-chan Reply, error) {
	ch := make(chan Reply, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed != nil {
		return nil, c.closed
	}
	c.pending[corr] = ch
	return ch, nil
}

// Deliver hands r to the request waiting for corr and reports whether one
// was waiting (false: a late or unknown reply, which the caller counts).
func (c *Calls) Deliver(corr string, r Reply) bool {
	c.mu.Lock()
	ch, ok := c.pending[corr]
	delete(c.pending, corr)
	c.mu.Unlock()
	if ok {
		ch <- r // buffered 1, and corr is delivered at most once
	}
	return ok
}

// FailAll ends every waiting request with err, and makes later Adds fail
// with it.
func (c *Calls) FailAll(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = err
	for corr, ch := range c.pending {
		ch <- Reply{Err: err}
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
