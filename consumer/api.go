// Package consumer is km0's consume pipeline, the same over every broker: it
// runs a Handler for each event of the tipus it handles, records the
// idempotency key in the same transaction as the effect (the idempotent
// consumer pattern; table missatges_processats), settles a message with the
// broker only after that transaction (at-least-once; AtMostOnce is
// explicit), reruns a transaction in place after a deadlock or a
// serialisation failure and waits out a database outage without spending an
// attempt, and moves failures off the stream: transient ones to a retry with
// backoff, permanent ones (and exhausted transients) to a dead letter with a
// motiu.
//
// The broker is a Source: kafka.NewSource (a consumer group; retries on
// <topic>.retry, dead letters on <topic>.dlq) or amqp.NewSource (a work
// queue or ordered shard queues; retries through wait queues, dead letters
// to <queue>.dlq through the DLX). Everything else in Config is the same on
// both.
package consumer

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/transport"
)

// Message is one delivered event as a Handler sees it.
type Message struct {
	*transport.Message        // topic (AMQP: routing key), key, raw value, headers
	OriginalTopic      string // the domain topic (Topic, or the topic a retry copy came from), or the work queue
	Partition          int32  // Kafka partition; RabbitMQ shard (0 on a plain queue)
	Offset             int64  // Kafka offset; -1 on RabbitMQ
	// IdempotencyKey is what the inbox records: the envelope member
	// "correlacio" when present (the shared id of a dual-published pair, so a
	// consumer accepting both copies handles the pair once), else
	// id_esdeveniment.
	idempotencyKey string
	Envelope       *envelope.Envelope // decoded (and upcast) envelope
	Attempt        int                // 1 for the first delivery, 2 for the first retry...
	FirstFailure   time.Time          // zero on the first attempt

	ctx context.Context // the context of the message's consumer span; see Context
}

// Context returns the context of this message's consumer span, the child of
// the trace its producer stored in the outbox (package tracing). A Handler
// receives it as its ctx already; a batch handler, whose ctx is the batch's,
// uses it for what one message causes, e.g. outbox.Event.Headers:
// tracing.Headers(m.Context()), so each event continues its own message's
// trace. context.Background() when unset.
func (m *Message) Context() context.Context {
	if m.ctx == nil {
		return context.Background()
	}
	return m.ctx
}

// SetContext sets what Context returns. Consumers call it when they start
// the message's consumer span (tracing.ConsumerContext).
func (m *Message) SetContext(ctx context.Context) { m.ctx = ctx }

// Handler applies the effect of one event inside tx, the transaction in which
// the consumer also records (id_esdeveniment, consumidor). It returns nil on
// success; outcome.Permanent(err) to dead-letter now; outcome.Transient(err)
// or outcome.RetryAfter(d, err) to retry later; any other error is classified
// by Config.Classifier (default: transient). A panic is recovered, logged with
// its stack and counted as a transient failure of that attempt.
// When the handler returns an error, everything it did in tx is rolled back,
// and so is the key: nothing of a failed attempt persists.
type Handler func(ctx context.Context, tx pgx.Tx, m *Message) error

// BatchHandler applies the effects of several messages of one lane (a Kafka
// partition, a RabbitMQ queue worker), in their order, inside tx (see
// Config.HandleBatch). It must apply all of them or return an error; it
// needs no error attribution, since on any error the consumer rolls back
// and runs the messages one by one with the Handler.
// A deadlock or serialisation failure (SQLSTATE 40P01, 40001) is not such an
// error: the consumer reruns the whole batch in place (see
// Config.HandleBatchOutcomes).
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []*Message) error

// BatchOutcomeHandler applies the effects of several messages of one
// lane inside tx, and may refuse some of them on their own (see
// Config.HandleBatchOutcomes). msgs are the new messages of the transaction
// (duplicates are already absorbed), in their order.
//
// It returns one error per message, outcomes[i] for msgs[i]:
//   - nil: message i is applied; its effect and its idempotency key commit
//     together with the rest of the transaction.
//   - an error: message i is refused. The handler must have left nothing of
//     message i in tx (compute first, then write only the accepted ones, or
//     use a savepoint). The consumer deletes message i's key in tx, so the
//     refusal rolls the key back exactly as a failed Handler does, and routes
//     the error as the one-message path does: outcome.Permanent is
//     dead-lettered at this attempt, a transient error retried (attempt
//     n+1) or dead-lettered when the attempts are spent; other errors are
//     classified by Config.Classifier.
//
// A nil slice means every message was applied. The second result fails the
// whole batch: the transaction rolls back, and the messages run again one by
// one (with Config.Handle if set, else with this handler on a batch of one),
// unless it is a deadlock or serialisation failure (SQLSTATE 40P01, 40001),
// which reruns the same batch in place without spending an attempt. A slice
// of the wrong length, or a panic, is a failure of the whole batch too.
type BatchOutcomeHandler func(ctx context.Context, tx pgx.Tx, msgs []*Message) (outcomes []error, err error)

// Mode says where the settlement (Kafka offset commit, RabbitMQ ack) goes
// relative to the effect.
type Mode int

const (
	// AtLeastOnce (default): settle after the effect's transaction. A crash
	// in between redelivers; the inbox absorbs the duplicate.
	AtLeastOnce Mode = iota
	// AtMostOnce: settle before processing. A crash loses the message. Only
	// for data the next message replaces (analitica, telemetry). Failures
	// are still retried and dead-lettered.
	AtMostOnce
)

// Order says whether a consumer keeps the order of a key's messages through
// retries and dead letters (Config.Order).
type Order int

const (
	// Unordered (default): a failed message goes to its retry and the
	// messages behind it go on; on Kafka and in RabbitMQ's ordered mode
	// order per key holds only while nothing fails.
	Unordered Order = iota
	// PerKey: while a key's head waits for a retry or sits in the DLQ, the
	// later messages of the key are parked (package keyorder) and applied
	// in order once the head succeeds. Other keys never wait.
	PerKey
)

// Behind is what happens to the messages parked behind a dead-lettered head
// (Config.Behind).
type Behind = keyorder.Policy

// Policies of Config.Behind.
const (
	DeadLetterBlocked = keyorder.DeadLetterBlocked // copied to the DLQ as blocked by the head, and kept parked
	StayParked        = keyorder.StayParked        // kept parked only
)
