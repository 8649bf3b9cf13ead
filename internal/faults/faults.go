// Package faults holds km0's crash points: functions a fault-injection test
// (or the demo's chaos run) places at an exact point of the relay or of a
// consumer, to prove what survives a process death there. They are not
// public API: a program outside this module cannot reach them, and the
// public hooks of the packages are for observation only.
//
// Crash points travel in the context given to Run (or RunOnce): each run
// gets its own, and a context without them costs one lookup per run.
package faults

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
)

// ErrCrashed is what a crash point returns to make the relay or a consumer
// act as if its process died right there. The consumer (or relay) stops at
// once, commits nothing more, and its Run returns an error wrapping
// ErrCrashed. Any other non-nil error of a crash point counts the same.
var ErrCrashed = errors.New("crashed (fault injection)")

// Consumer are a consumer's crash points. Each is optional. M is the
// pipeline's message type (*consumer.Message), a type parameter so that
// this package does not import package consumer.
type Consumer[M any] struct {
	// BeforeTxCommit runs inside a transaction after the handlers and before
	// COMMIT: a crash mid-transaction.
	BeforeTxCommit func(ctx context.Context, tx pgx.Tx, msgs []M) error
	// AfterCommit runs after a transaction committed and before the source
	// settles its messages (offset commit, ack): a crash between the two.
	AfterCommit func(ctx context.Context, msgs []M) error
	// BeforeSourceCommit runs after the broker confirmed the retry and DLQ
	// copies of a batch's failures and before their originals are settled
	// (offset marked, delivery acked). copies is how many.
	BeforeSourceCommit func(ctx context.Context, copies int) error
}

// Relay are the relay's crash points and test probes. Each is optional.
type Relay struct {
	// AfterPublish runs after the broker confirmed every record of a batch
	// and before the mark commits. A non-nil error makes the relay act as if
	// its process died right there: the rows stay pending and Run/RunOnce
	// return the error.
	AfterPublish func(rows int) error
	// Listening runs each time the LISTEN session is (re)established.
	Listening func()
	// Claimed runs after each claim that returned rows, with the worker's
	// index, the claim's size (its LIMIT) and the rows it returned.
	Claimed func(worker, limit, rows int)
}

// CDC are the CDC relay's crash points and test probes (package
// relay/cdc). Each is optional. A non-nil error makes the relay act as if
// its process died at that point: its sessions are closed without marking
// or confirming anything more, and Run returns the error.
type CDC struct {
	// AfterPublish runs after the broker confirmed every record of a batch,
	// before its rows are marked and before its position is confirmed.
	AfterPublish func(rows int) error
	// AfterMark runs after a batch's rows were marked published (committed),
	// before its position is confirmed to the server.
	AfterMark func(rows int) error
	// Streaming runs each time the relay holds the slot and starts streaming,
	// after the catch-up of pending rows.
	Streaming func()
}

// Payments are the crash points of the pagaments service's handlers
// (services/pagaments). Each is optional. A non-nil error aborts the
// attempt there, as if the process died: the handler returns it, the
// consumer's transaction rolls back and the message is redelivered.
type Payments struct {
	// AfterCharge runs after the gateway charged an order and before the
	// transaction commits.
	AfterCharge func(orderID string) error
	// AfterRefund runs after the gateway refunded an order and before the
	// transaction commits.
	AfterRefund func(orderID string) error
}

type consumerKey struct{}
type paymentsKey struct{}
type relayKey struct{}
type cdcKey struct{}

// WithConsumer returns ctx carrying the consumer crash points h.
func WithConsumer[M any](ctx context.Context, h Consumer[M]) context.Context {
	return context.WithValue(ctx, consumerKey{}, &h)
}

// ConsumerFrom returns the consumer crash points of ctx (zero when none).
func ConsumerFrom[M any](ctx context.Context) Consumer[M] {
	if h, ok := ctx.Value(consumerKey{}).(*Consumer[M]); ok {
		return *h
	}
	return Consumer[M]{}
}

// WithRelay returns ctx carrying the relay crash points h.
func WithRelay(ctx context.Context, h Relay) context.Context {
	return context.WithValue(ctx, relayKey{}, &h)
}

// RelayFrom returns the relay crash points of ctx (nil when none).
func RelayFrom(ctx context.Context) *Relay {
	h, _ := ctx.Value(relayKey{}).(*Relay)
	return h
}

// WithCDC returns ctx carrying the CDC relay crash points h.
func WithCDC(ctx context.Context, h CDC) context.Context {
	return context.WithValue(ctx, cdcKey{}, &h)
}

// CDCFrom returns the CDC relay crash points of ctx (zero when none).
func CDCFrom(ctx context.Context) CDC {
	if h, ok := ctx.Value(cdcKey{}).(*CDC); ok {
		return *h
	}
	return CDC{}
}

// WithPayments returns ctx carrying the pagaments crash points h. They
// reach the handlers through the consumer's Run context.
func WithPayments(ctx context.Context, h Payments) context.Context {
	return context.WithValue(ctx, paymentsKey{}, &h)
}

// PaymentsFrom returns the pagaments crash points of ctx (zero when none).
func PaymentsFrom(ctx context.Context) Payments {
	if h, ok := ctx.Value(paymentsKey{}).(*Payments); ok {
		return *h
	}
	return Payments{}
}
