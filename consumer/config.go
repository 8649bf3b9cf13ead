package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
)

// Defaults of Config.
const (
	// MaxAttemptsDefault is the number of attempts in all (CONTRACT.md: 3).
	MaxAttemptsDefault = 3
	// BackoffDefault is the delay before the second attempt; the delay before
	// attempt n+1 is Backoff × 2^(n−1) (1 s, 2 s, 4 s...).
	BackoffDefault = time.Second
	// BackoffMaxDefault caps the delay between attempts.
	BackoffMaxDefault = time.Hour
	// BatchSizeDefault is how many messages of one lane (a Kafka partition,
	// a RabbitMQ queue worker) share a transaction (each with its own key;
	// see Config.BatchSize).
	BatchSizeDefault = 100
	// ShutdownTimeoutDefault bounds how long Run waits, once its context is
	// done, for in-flight batches to finish before abandoning them (their
	// transactions roll back and they are redelivered).
	ShutdownTimeoutDefault = 30 * time.Second
)

// ErrConfig is wrapped by every configuration error of New.
var ErrConfig = errors.New("consumer: invalid config")

// Config configures a Consumer. Fields without a default are required. Only
// Source names the broker: moving a consumer from Kafka to RabbitMQ changes
// its Source and nothing else.
type Config struct {
	// Source is the broker's half: kafka.NewSource (a consumer group on
	// domain topics, with their .retry and .dlq topics) or amqp.NewSource
	// (a work queue or the shard queues of ordered mode, with wait queues
	// and the DLX). Required; a Source runs in one Consumer only.
	Source transport.Source
	// Name is the consumidor of the idempotency key, e.g.
	// "inventari.descompte_estoc". Required unless NoInbox.
	Name string
	// Pool runs the transactions. Required.
	Pool *pgxpool.Pool
	// Inbox records the keys. Default inbox.New with Names.
	Inbox *inbox.Inbox
	// Names locates missatges_processats when Inbox is nil. Default
	// public.missatges_processats.
	Names migrate.Names
	// Handle applies the effect of one message. Required unless
	// HandleBatchOutcomes is set.
	Handle Handler
	// HandleBatch, if set, applies the effects of all the new messages of a
	// transaction at once (e.g. one multi-row statement, or a pgx.Batch: one
	// round trip instead of one per message). If it returns an error, the
	// transaction rolls back and its messages run again one by one with
	// Handle, which decides the fate of each. Default nil: Handle only.
	HandleBatch BatchHandler
	// HandleBatchOutcomes, if set, applies the effects of all the new
	// messages of a transaction at once and may refuse individual messages
	// with their own outcome (see BatchOutcomeHandler): the accepted ones
	// commit with their keys, each refused one loses its key in the same
	// transaction and is retried or dead-lettered as if Handle had failed on
	// it alone, with no rerun of its neighbours. It runs for every
	// transaction, batches of one included. At most one of HandleBatch and
	// HandleBatchOutcomes may be set. Default nil.
	HandleBatchOutcomes BatchOutcomeHandler
	// Types are the tipus handled; others are ignored (counted, settled,
	// never dead-lettered), on the tipus header before decoding when it is
	// unambiguous. A message whose tipus headers disagree with each other or
	// with the envelope is a permanent failure (dead letter, motiu
	// "permanent: esquema: header tipus …"), whatever Types holds.
	// Empty: every tipus.
	Types []string
	// Decode decodes a message value. Default envelope.Decoder{}.Decode; a
	// schema.Decoder's Decode validates and upcasts. Its errors, and its
	// panics (recovered, logged with the stack), are permanent: the message
	// is dead-lettered at attempt 1. An error wrapping outcome.ErrIgnore
	// ignores the message instead.
	Decode func([]byte) (*envelope.Envelope, error)
	// Mode places the settlement (offset commit, ack). Default AtLeastOnce.
	Mode Mode
	// Order keeps, with PerKey, the order of the messages of one key
	// through retries and dead letters: while a key's head waits for a retry
	// or sits in the DLQ, the later messages of that key are parked in
	// PostgreSQL (package keyorder) and applied in order after the head
	// (see docs/consuming.md, "Per-key order"). The key is the message key
	// (transport.Message.Key: the Kafka record key, the RabbitMQ header
	// clau), which km0's relay sets to agregat_id on both brokers; a
	// message without one keeps no order. Needs the keyorder migrations,
	// the inbox and AtLeastOnce, and a source that hands each key to one
	// lane (Kafka; RabbitMQ in ordered mode or with one worker). Default
	// Unordered.
	Order Order
	// Behind chooses, with PerKey, what happens to the messages parked
	// behind a head that is dead-lettered: DeadLetterBlocked (the default)
	// copies each to the DLQ as blocked by the head (motiu
	// "permanent: bloquejat_per_clau: …") and keeps it parked; StayParked
	// keeps them parked only. Either way replaying the head releases them
	// in order.
	Behind Behind
	// FinalFailure, with PerKey, reports whether a permanent failure is a
	// final business outcome rather than a fault (inventari's insufficient
	// stock: the refusal is recorded and compensated, nobody will fix and
	// replay it). Such a message is dead-lettered as usual, but its key does
	// not wait for it: the messages behind it are applied. Default nil:
	// every dead-lettered head blocks its key.
	FinalFailure func(err error) bool
	// NoInbox skips the idempotency key, for handlers idempotent by nature
	// (SET flag = ...). Default false.
	NoInbox bool
	// MaxAttempts is the number of attempts in all before a transient failure
	// is dead-lettered. A retry copy's intents is read within it
	// (contract.Attempt). Default MaxAttemptsDefault.
	MaxAttempts int
	// Backoff is the delay before the second attempt; it doubles for each
	// later one. outcome.RetryAfter overrides it. Default BackoffDefault.
	Backoff time.Duration
	// BackoffMax caps that delay, and a RetryAfter delay too. It is also
	// the longest a retry copy is held whatever its no_abans says
	// (contract.NotBefore). Default BackoffMaxDefault.
	BackoffMax time.Duration
	// Classifier classifies handler errors that carry no outcome. Default
	// outcome.DefaultClassifier (transient).
	Classifier outcome.Classifier
	// Concurrency is how many transactions run at once (each holds one
	// connection of Pool while it does); a RabbitMQ source also runs this
	// many workers on a plain queue. Default: Pool's MaxConns.
	Concurrency int
	// BatchSize is how many messages of one lane share a transaction. Each
	// keeps its own key and effect: a failing message is retried alone and
	// never takes its neighbours with it. 1 runs one transaction per
	// message. Default BatchSizeDefault.
	BatchSize int
	// ShutdownTimeout bounds Run's stop once its context is done: the wait
	// for in-flight work (and on Kafka the group leave, which gets at least
	// a second). Default ShutdownTimeoutDefault.
	ShutdownTimeout time.Duration
	// Pause, if set, is an operator's switch: while it is on the consumer
	// takes no new batch (see Pause, WatchPauses). Default nil: never paused.
	Pause *Pause
	// Logger receives the consumer's logs. Default slog.Default().
	Logger *slog.Logger
	// Metrics, if set, receives the consumer's Prometheus collectors
	// (km0_consumer_messages_total, km0_dlq_total, km0_consumer_retry_held,
	// km0_consumer_conflicts_total), labelled grup (Source.Label) and
	// consumidor (Name).
	Metrics prometheus.Registerer
	// OnCommit, if set, observes each committed transaction: msgs are the
	// messages it applied (duplicates and refused ones excluded). It runs
	// after COMMIT and before the source settles them; it must not block
	// for long and cannot change any outcome. Default nil.
	OnCommit func(ctx context.Context, msgs []*Message)
	// OnDeadLetter, if set, observes each dead letter once its copy is safe
	// (confirmed by the broker, or nacked to the DLX), with its motiu.
	// Default nil.
	OnDeadLetter func(ctx context.Context, m *Message, motiu string)
}

// WithDefaults returns cfg with empty fields set to their defaults.
func (cfg Config) WithDefaults() Config {
	cfg.Names = cfg.Names.WithDefaults()
	if cfg.Inbox == nil {
		cfg.Inbox = inbox.New(inbox.Config{Names: cfg.Names})
	}
	if cfg.Decode == nil {
		cfg.Decode = envelope.Decoder{}.Decode
	}
	if cfg.Classifier == nil {
		cfg.Classifier = outcome.DefaultClassifier
	}
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, MaxAttemptsDefault)
	cfg.Backoff = cmp.Or(cfg.Backoff, BackoffDefault)
	cfg.BackoffMax = cmp.Or(cfg.BackoffMax, BackoffMaxDefault)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, BatchSizeDefault)
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, ShutdownTimeoutDefault)
	if cfg.Concurrency == 0 && cfg.Pool != nil {
		cfg.Concurrency = int(cfg.Pool.Config().MaxConns)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg
}

func (cfg Config) validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if cfg.Source == nil {
		bad("no Source (kafka.NewSource or amqp.NewSource)")
	}
	if cfg.Name == "" && !cfg.NoInbox {
		bad("no Name (the consumidor of the idempotency key); set NoInbox for a handler idempotent by nature")
	} else if err := inbox.CheckConsumer(cfg.Name); cfg.Name != "" && err != nil {
		bad("Name: %v", err)
	}
	if cfg.Pool == nil {
		bad("no Pool")
	}
	if cfg.Handle == nil && cfg.HandleBatchOutcomes == nil {
		bad("no Handle (or HandleBatchOutcomes)")
	}
	if cfg.HandleBatch != nil && cfg.HandleBatchOutcomes != nil {
		bad("both HandleBatch and HandleBatchOutcomes set; choose one")
	}
	if cfg.Mode != AtLeastOnce && cfg.Mode != AtMostOnce {
		bad("unknown Mode %d", cfg.Mode)
	}
	if cfg.Order != Unordered && cfg.Order != PerKey {
		bad("unknown Order %d", cfg.Order)
	}
	if cfg.Behind != DeadLetterBlocked && cfg.Behind != StayParked {
		bad("unknown Behind %d", cfg.Behind)
	}
	if cfg.Order == PerKey {
		if cfg.NoInbox {
			bad("Order PerKey needs the inbox (NoInbox is set): a parked message is released only once")
		}
		if cfg.Mode == AtMostOnce {
			bad("Order PerKey needs AtLeastOnce: a message is parked in the transaction that settles it")
		}
		if cfg.Source != nil {
			if err := cfg.Source.KeyOrder(); err != nil {
				bad("Order PerKey: %v", err)
			}
		}
	}
	if cfg.MaxAttempts < 1 {
		bad("MaxAttempts %d < 1", cfg.MaxAttempts)
	}
	for name, d := range map[string]time.Duration{"Backoff": cfg.Backoff, "BackoffMax": cfg.BackoffMax, "ShutdownTimeout": cfg.ShutdownTimeout} {
		if d < 0 {
			bad("negative %s %v", name, d)
		}
	}
	if cfg.Concurrency < 1 {
		bad("Concurrency %d < 1", cfg.Concurrency)
	}
	if cfg.BatchSize < 1 {
		bad("BatchSize %d < 1", cfg.BatchSize)
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrConfig, errors.Join(errs...))
	}
	return nil
}
