package amqp

import (
	"math"
	"time"

	"github.com/km0/km0/contract"
	amqp "github.com/rabbitmq/amqp091-go"
)

// DeadLetter is one message of a DLQ, as the DLQ index reads it.
type DeadLetter struct {
	DLQ       string // the queue it is in, <queue>.dlq
	Origin    string // the queue it died in: where Replay sends it
	MessageID string // AMQP message_id (km0 sets it to id_esdeveniment)
	EventID   string // header id_esdeveniment
	Type      string // header tipus
	// Reason is the motiu header for a dead letter km0 published (exhausted
	// retries), or, for a native one, "permanent: rejected by <queue>" built
	// from x-death (the handler's error text is in the consumer's log).
	Reason   string
	Attempts int       // header intents (0 when absent or negative, at most 2^31-1: an INTEGER)
	DeadAt   time.Time // header mort_en, else x-death time; zero if unknown
	Headers  amqp.Table
	Body     []byte
}

// DeadLetterOf reads a delivery got from the DLQ of queue (the work queue,
// not <queue>.dlq): origin from cua_origen or x-death, motiu from the header
// or, for a native nack, "permanent: rejected by <queue>", attempts and time
// of death. It is for callers that read the DLQ themselves: the PostgreSQL
// index of package dlq (`km0 dlq`), which is km0's one set of DLQ
// operations. It never fails: what is missing stays at its zero value
// (Origin defaults to queue).
func DeadLetterOf(queue string, d *amqp.Delivery) *DeadLetter {
	dlqName := contract.DLQName(queue)
	dl := &DeadLetter{DLQ: dlqName, MessageID: d.MessageId, Type: d.Type, Headers: d.Headers, Body: d.Body,
		Attempts: int(min(max(headerInt(d.Headers, contract.HeaderAttempts), 0), math.MaxInt32))}
	_, ownCopy := d.Headers[contract.HeaderReason]
	dl.EventID, _ = d.Headers[contract.HeaderEventID].(string)
	if t, ok := d.Headers[contract.HeaderType].(string); ok {
		dl.Type = t
	}
	dl.Reason, _ = d.Headers[contract.HeaderReason].(string)
	dl.Origin, _ = d.Headers[HeaderOriginQueue].(string)
	dl.DeadAt, _ = headerTime(d.Headers, contract.HeaderDeadAt)
	if deaths := XDeaths(d.Headers); len(deaths) > 0 {
		last := deaths[0]
		if dl.Origin == "" {
			dl.Origin = last.Queue
		}
		if !ownCopy {
			// intents counts the attempts before the one that was rejected.
			if dl.Attempts < math.MaxInt32 {
				dl.Attempts++
			}
			if last.Reason == "rejected" {
				dl.Reason = "permanent: rejected by " + last.Queue
			} else {
				dl.Reason = "x-death: " + last.Reason + " in " + last.Queue
			}
		}
		if dl.DeadAt.IsZero() {
			dl.DeadAt = last.Time
		}
	}
	if dl.Origin == "" {
		dl.Origin = queue
	}
	return dl
}
