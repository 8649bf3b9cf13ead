// Package outcome is the vocabulary a handler uses to say what should happen to a
// message it could not process: retry it later (Transient, RetryAfter) or move it
// to the dead-letter destination now (Permanent). It mirrors River's JobSnooze and
// JetStream's Nak/NakWithDelay/Term.
//
// An error that carries no outcome is classified by a Classifier; the default,
// DefaultClassifier, treats it as transient, because retrying something that may
// heal costs a few seconds while dead-lettering it costs an operator's time.
package outcome

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/pause"
)

// Kind is what happens next to a failed message.
type Kind int

const (
	// KindTransient means: try again later, with backoff, until attempts run out.
	KindTransient Kind = iota + 1
	// KindPermanent means: dead-letter now; retrying cannot help.
	KindPermanent
)

func (k Kind) String() string {
	switch k {
	case KindTransient:
		return "transient"
	case KindPermanent:
		return "permanent"
	default:
		return "unknown"
	}
}

// Error is an error with an outcome attached. Build it with Permanent, Transient
// or RetryAfter; unwrap it with errors.As.
type Error struct {
	Kind Kind
	// Delay, when positive, overrides the backoff for the next attempt
	// (RetryAfter). Zero means "use the configured backoff".
	Delay time.Duration
	Err   error
}

func (e *Error) Error() string {
	if e.Err == nil {
		return e.Kind.String()
	}
	return e.Err.Error()
}

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }

// Permanent marks err as permanent: the message goes to the dead-letter
// destination at this attempt. Permanent(nil) returns nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &Error{Kind: KindPermanent, Err: err}
}

// Permanentf is Permanent(fmt.Errorf(format, args...)).
func Permanentf(format string, args ...any) error {
	return Permanent(fmt.Errorf(format, args...))
}

// Transient marks err as transient: the message is retried with backoff until
// the attempts run out, then dead-lettered. Transient(nil) returns nil.
func Transient(err error) error {
	if err == nil {
		return nil
	}
	return &Error{Kind: KindTransient, Err: err}
}

// RetryAfter is Transient with an explicit delay before the next attempt.
// RetryAfter(d, nil) returns nil.
func RetryAfter(d time.Duration, err error) error {
	if err == nil {
		return nil
	}
	return &Error{Kind: KindTransient, Delay: d, Err: err}
}

// ErrIgnore is matched (errors.Is) by an error that means "not for this
// consumer": the message is skipped and counted like a tipus the consumer does
// not handle, its offset committed, and it is neither retried nor
// dead-lettered. A Decode hook returns it, e.g. for the newer copy of a
// dual-published pair (package schema).
var ErrIgnore = errors.New("outcome: ignore this message")

// Classifier decides the Kind of an error that carries no outcome.
type Classifier func(error) Kind

// DefaultClassifier treats every unclassified error as transient, except a
// cancelled context (the caller is shutting down: transient too, so the message
// is redelivered rather than lost).
func DefaultClassifier(error) Kind { return KindTransient }

// Classify returns the Kind of err: the outcome it carries, or else what c says
// (DefaultClassifier when c is nil). Classify(nil) is 0.
func Classify(err error, c Classifier) (Kind, time.Duration) {
	if err == nil {
		return 0, 0
	}
	var oe *Error
	if errors.As(err, &oe) {
		return oe.Kind, oe.Delay
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return KindTransient, 0
	}
	if c == nil {
		c = DefaultClassifier
	}
	return c(err), 0
}

// IsPermanent reports whether err carries a permanent outcome.
func IsPermanent(err error) bool {
	var oe *Error
	return errors.As(err, &oe) && oe.Kind == KindPermanent
}

// Reason returns the contract's `motiu` text for a dead letter: "permanent: …"
// or "transitori esgotat: …", cut to 200 bytes on a rune boundary.
func Reason(kind Kind, err error) string {
	prefix := contract.ReasonPermanent
	if kind == KindTransient {
		prefix = contract.ReasonExhausted
	}
	msg := "?"
	if err != nil {
		msg = err.Error()
	}
	return Truncate(prefix+msg, 200)
}

// Truncate cuts s to at most n bytes without splitting a UTF-8 rune.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && (s[n]&0xC0) == 0x80 {
		n--
	}
	return s[:n]
}

// Backoff is the delay before attempt+1 after attempt failed: base ×
// 2^(attempt−1), capped at ceiling (a ceiling ≤ 0 means no cap other than overflow).
// It never overflows, whatever attempt a retry copy claims. It is km0's one
// backoff schedule (internal/pause) without the jitter: the contract states
// these waits, and RabbitMQ names its wait queues after them.
func Backoff(base, ceiling time.Duration, attempt int) time.Duration {
	return pause.Delay(base, ceiling, attempt)
}
