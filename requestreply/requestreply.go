// Package requestreply is request/reply over a message broker (the request/reply
// pattern): a requester sends a request with a correlation id and a reply address
// and waits, with a deadline, for the reply that carries the same correlation
// id. The API here is shared by two transports: requestreply/amqprr
// (RabbitMQ: reply_to, correlation_id) and requestreply/kafkarr (Kafka: a reply
// topic per client and a correlation header), so the embedded mode without
// RabbitMQ can use it too.
//
// Servers run a Handler. Idempotent makes a handler safe to retry: the
// response is stored with the effect, keyed by request id, and a repeat gets
// the stored response without running the effect again (like inventari's
// id_reserva / ReservarEstoc).
package requestreply

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outcome"
)

// TimeoutDefault is the deadline of a request whose context has none
// (CONTRACT.md: the requester times out after 5 s).
const TimeoutDefault = 5 * time.Second

// Requester sends requests and waits for their replies.
type Requester interface {
	// Request sends body to service and returns the reply body. requestID
	// identifies the request across retries (pass the same id to retry safely
	// against an Idempotent server; empty means a fresh one). It returns a
	// *TimeoutError when ctx's deadline (or the default timeout) passes
	// first, a *RemoteError when the server replied with an error, and
	// ctx.Err() when ctx is cancelled.
	Request(ctx context.Context, service string, requestID string, body []byte) ([]byte, error)
}

// Request is one request as a server's Handler sees it.
type Request struct {
	ID            string // request id: stable across retries; the idempotency key
	CorrelationID string // this attempt's correlation id
	Body          []byte
	// ReplyTo is the reply address the request named (reply_to over
	// RabbitMQ, DirectReplyTo's name for any direct reply-to consumer;
	// respondre_a over Kafka): part of the signed bytes.
	ReplyTo string
	// Deadline is the request's HeaderDeadline value as sent ("" if none).
	Deadline string
	// Signature is the request's HeaderSignature value ("" if unsigned):
	// see Verifier.
	Signature string
}

// Handler answers one request. A returned error becomes an error reply
// (*RemoteError at the requester) with the error's text; it is retryable
// unless it carries outcome.Permanent (bad requests must: see BadRequest).
// A panic is recovered and answered as a retryable internal error.
type Handler func(ctx context.Context, req *Request) ([]byte, error)

// Sentinels.
var (
	// ErrTimeout: no reply within the deadline (errors.Is on *TimeoutError).
	ErrTimeout = errors.New("requestreply: timeout")
	// ErrRemote: the server answered with an error (errors.Is on *RemoteError).
	ErrRemote = errors.New("requestreply: error reply")
	// ErrNoService: the broker could not route the request: no server queue
	// (RabbitMQ returned it as unroutable).
	ErrNoService = errors.New("requestreply: no server for the service")
	// ErrConnectionLost: the connection that held this request's reply queue
	// was lost before the reply. The request may have been processed: retry
	// with the same request id.
	ErrConnectionLost = errors.New("requestreply: connection lost while waiting for the reply")
	// ErrClosed: the requester was closed.
	ErrClosed = errors.New("requestreply: closed")
)

// TimeoutError is a request that got no reply within its deadline. The
// request may still be processed (retry with the same id against an
// Idempotent server); a reply that arrives later is dropped and counted.
type TimeoutError struct {
	Service   string
	RequestID string
	After     time.Duration
}

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("requestreply: no reply from %s to request %s within %v", e.Service, e.RequestID, e.After.Round(time.Millisecond))
}

// Is makes errors.Is(err, ErrTimeout) and errors.Is(err,
// context.DeadlineExceeded) true.
func (e *TimeoutError) Is(target error) bool {
	return target == ErrTimeout || target == context.DeadlineExceeded
}

// RemoteError is an error reply.
type RemoteError struct {
	Service   string
	Message   string // the server's error text
	Retryable bool   // false for permanent errors such as a bad request
	// Conflict: the server holds a different request under the same key
	// (see Conflict); never retryable.
	Conflict bool
}

func (e *RemoteError) Error() string {
	return fmt.Sprintf("requestreply: %s answered with an error: %s", e.Service, e.Message)
}

// Is makes errors.Is(err, ErrRemote) true, and errors.Is(err, ErrConflict)
// for a conflict reply.
func (e *RemoteError) Is(target error) bool {
	return target == ErrRemote || (target == ErrConflict && e.Conflict)
}

// BadRequest marks err as a bad request: the server answers with a
// non-retryable error reply (outcome.Permanent).
func BadRequest(err error) error { return outcome.Permanent(err) }

// DecodeJSON unmarshals a request body into v strictly (internal/strictjson:
// invalid UTF-8, lone surrogate escapes, repeated members and members named
// like a field but for case are refused, unknown members ignored). A refused
// body is a BadRequest error saying so ("bad request: malformed JSON: ..."),
// which Handler turns into a non-retryable error reply.
func DecodeJSON(body []byte, v any) error {
	if err := strictjson.Unmarshal(body, v); err != nil {
		return BadRequest(fmt.Errorf("bad request: malformed JSON: %w", err))
	}
	return nil
}

// MaxBodyBytesDefault is the largest request body the servers (amqprr,
// kafkarr) hand their handler unless configured otherwise: 64 KiB.
const MaxBodyBytesDefault = 64 << 10

// LimitBody returns h refusing, without running it, a request whose body
// is longer than limit bytes (MaxBodyBytesDefault when limit is 0; no bound
// when it is negative): the requester gets a non-retryable error reply
// naming the size and the limit. The servers wrap their Handler with it.
func LimitBody(h Handler, limit int) Handler {
	if limit == 0 {
		limit = MaxBodyBytesDefault
	}
	if limit < 0 {
		return h
	}
	return func(ctx context.Context, req *Request) ([]byte, error) {
		if len(req.Body) > limit {
			return nil, BadRequest(fmt.Errorf("bad request: body of %d bytes, over the limit of %d", len(req.Body), limit))
		}
		return h(ctx, req)
	}
}

// Wire format shared by the transports: a header "resultat" says "ok" or
// "error"; an error reply's body is {"error": "...", "reintentable": bool}.
const (
	HeaderResult = "resultat"
	ResultOK     = "ok"
	ResultError  = "error"
)

type errorBody struct {
	Error     string `json:"error"`
	Retryable bool   `json:"reintentable"`
	Conflict  bool   `json:"conflicte,omitempty"`
}

// Serve runs h on req, recovering a panic (logged with its stack on log),
// and returns the reply body and whether it is an error reply. Transports
// call it. An error that carries a PostgreSQL error is answered without
// PostgreSQL's text (see redact).
func Serve(ctx context.Context, log *slog.Logger, h Handler, req *Request) (body []byte, isError bool) {
	resp, err := safeCall(ctx, log, h, req)
	if err == nil {
		if resp == nil {
			resp = []byte{}
		}
		return resp, false
	}
	err = redact(log, req, err)
	kind, _ := outcome.Classify(err, nil)
	conflict := errors.Is(err, ErrConflict)
	b, _ := json.Marshal(errorBody{Error: outcome.Truncate(err.Error(), 1000), Retryable: kind != outcome.KindPermanent && !conflict, Conflict: conflict})
	return b, true
}

func safeCall(ctx context.Context, log *slog.Logger, h Handler, req *Request) (resp []byte, err error) {
	defer func() {
		if r := recover(); r != nil {
			log.Error("requestreply: handler panicked", "id_peticio", req.ID, "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("internal error: panic: %v", r)
		}
	}()
	return h(ctx, req)
}

// DecodeReply turns a reply (its resultat header and body) into the
// requester's result.
func DecodeReply(service, result string, body []byte) ([]byte, error) {
	if result != ResultError {
		return body, nil
	}
	var eb errorBody
	if err := json.Unmarshal(body, &eb); err != nil || eb.Error == "" {
		return nil, &RemoteError{Service: service, Message: string(body)}
	}
	return nil, &RemoteError{Service: service, Message: eb.Error, Retryable: eb.Retryable && !eb.Conflict, Conflict: eb.Conflict}
}

// IDs makes correlation ids for one requester: a random prefix, drawn once,
// and a counter. They are unique without a random draw (a syscall) per
// request. The zero value is not usable: call NewIDs.
type IDs struct {
	prefix string
	n      atomic.Uint64
}

// NewIDs returns an id source with a fresh 64-bit random prefix.
func NewIDs() *IDs {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return &IDs{prefix: hex.EncodeToString(b) + "-"}
}

// Prefix returns the random part shared by all ids of this source.
func (s *IDs) Prefix() string { return s.prefix[:len(s.prefix)-1] }

// Next returns a new id.
func (s *IDs) Next() string { return s.prefix + strconv.FormatUint(s.n.Add(1), 10) }
