package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport/kafka"
)

// Defaults of Config.
const (
	// MaxAttemptsDefault is the number of attempts in all (CONTRACT.md: 3).
	MaxAttemptsDefault = 3
	// BackoffDefault is the delay before the second attempt; the delay before
	// attempt n+1 is Backoff × 2^(n−1) (1 s, 2 s, 4 s...).
	BackoffDefault = time.Second
	// BackoffMaxDefault caps the delay between attempts (as on RabbitMQ).
	BackoffMaxDefault = time.Hour
	// BatchSizeDefault is how many messages of one partition share a
	// transaction (each with its own key; see Config.BatchSize).
	BatchSizeDefault = 100
	// CommitIntervalDefault is the least time between two offset commits of
	// the background committer. A commit is issued as soon as work finishes
	// and the previous commit is at least this old.
	CommitIntervalDefault = 20 * time.Millisecond
	// ShutdownTimeoutDefault bounds how long Run waits, once its context is
	// done, for in-flight batches to finish before abandoning them (their
	// transactions roll back and their offsets stay uncommitted).
	ShutdownTimeoutDefault = 30 * time.Second
	// MaxHeldDefault is how many retry copies one retry partition may hold in
	// memory while waiting for their no_abans before the partition is paused.
	MaxHeldDefault = 10_000
	// RetrySuffix and DLQSuffix name a topic's retry and dead-letter topics.
	RetrySuffix = ".retry"
	DLQSuffix   = ".dlq"
)

// ErrCrashed is what a Hooks function returns to simulate the death of the
// process at that point: the consumer stops at once, commits no further offset,
// leaves in-flight transactions to roll back and Run returns an error wrapping
// ErrCrashed. Any other error returned by a hook is treated the same way.
var ErrCrashed = errors.New("consumer: crashed (fault injection)")

// ErrConfig is wrapped by every configuration error of New.
var ErrConfig = errors.New("consumer: invalid config")

// Hooks are fault-injection points for tests and drills. Each is optional. A
// non-nil error from any of them kills the consumer as a crash at that point
// would (see ErrCrashed).
type Hooks struct {
	// BeforeTxCommit runs inside a batch's transaction after the handlers and
	// before COMMIT: a crash mid-transaction.
	BeforeTxCommit func(ctx context.Context, tx pgx.Tx, msgs []*Message) error
	// AfterCommit runs after a batch's transaction committed and before its
	// offsets are marked for commit: a crash between the DB commit and the
	// offset commit.
	AfterCommit func(ctx context.Context, msgs []*Message) error
	// BeforeSourceCommit runs after the broker confirmed the retry and DLQ
	// copies of a batch's failures and before the batch's source offsets are
	// marked for commit.
	BeforeSourceCommit func(ctx context.Context, copies []*kgo.Record) error
}

// Config configures a Consumer. Fields without a default are required.
type Config struct {
	// Brokers are the Kafka bootstrap brokers. Required.
	Brokers []string
	// Group is the consumer group. Required.
	Group string
	// Topics are the domain topics consumed (not their .retry/.dlq topics,
	// which the consumer derives). Required.
	Topics []string
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
	// transaction and goes to .retry or .dlq as if Handle had failed on it
	// alone, with no rerun of its neighbours. It runs for every transaction,
	// batches of one included. At most one of HandleBatch and
	// HandleBatchOutcomes may be set. Default nil.
	HandleBatchOutcomes BatchOutcomeHandler
	// Types are the tipus handled; others are ignored (counted, offset
	// committed, never dead-lettered), on the tipus header before decoding
	// when it is unambiguous. A record whose tipus headers disagree with
	// each other or with the envelope is a permanent failure (DLQ, motiu
	// "permanent: esquema: capçalera tipus …"), whatever Types holds.
	// Empty: every tipus.
	Types []string
	// Decode decodes a record value. Default envelope.Decoder{}.Decode. Its
	// errors, and its panics (recovered, logged with the stack), are
	// permanent: the record goes to the DLQ at attempt 1.
	Decode func([]byte) (*envelope.Envelope, error)
	// Mode places the offset commit. Default AtLeastOnce.
	Mode Mode
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
	// Concurrency is how many partitions are processed at once (each holds one
	// connection of Pool while it does). Default: Pool's MaxConns.
	Concurrency int
	// BatchSize is how many messages of one partition share a transaction.
	// Each keeps its own key and effect: a failing message is retried alone
	// and never takes its neighbours with it. 1 runs one transaction per
	// message. Default BatchSizeDefault.
	BatchSize int
	// CommitInterval is the least time between two background offset
	// commits. Default CommitIntervalDefault.
	CommitInterval time.Duration
	// ShutdownTimeout bounds Run's stop once its context is done: the wait
	// for in-flight work and the group leave (which gets at least a second).
	// Default ShutdownTimeoutDefault.
	ShutdownTimeout time.Duration
	// MaxHeld bounds the retry copies held per retry partition. Default
	// MaxHeldDefault.
	MaxHeld int
	// TopicPartitions is the partition count used when the consumer creates a
	// missing .retry or .dlq topic. Default kafka.PartitionsDefault (6).
	TopicPartitions int32
	// NoCreateTopics stops Run from creating missing .retry and .dlq topics.
	NoCreateTopics bool
	// SessionTimeout is the group session timeout: a member that dies
	// without leaving (SIGKILL) loses its partitions to the others this long
	// after its last heartbeat. It must lie within the brokers'
	// group.min.session.timeout.ms and group.max.session.timeout.ms (the
	// minimum is 6 s by default), else joining the group fails. Default
	// kafka.SessionTimeoutDefault (10 s); the heartbeat interval follows
	// (see kafka.GroupOpts).
	SessionTimeout time.Duration
	// Logger receives the consumer's logs. Default slog.Default().
	Logger *slog.Logger
	// Metrics, if set, receives the consumer's Prometheus collectors
	// (km0_consumer_messages_total, km0_dlq_total, km0_consumer_retry_held,
	// km0_consumer_conflicts_total).
	Metrics prometheus.Registerer
	// Hooks are fault-injection points. Default none.
	Hooks Hooks
	// KgoOpts are appended to the client options (they win).
	KgoOpts []kgo.Opt
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
	cfg.CommitInterval = cmp.Or(cfg.CommitInterval, CommitIntervalDefault)
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, ShutdownTimeoutDefault)
	cfg.MaxHeld = cmp.Or(cfg.MaxHeld, MaxHeldDefault)
	cfg.TopicPartitions = cmp.Or(cfg.TopicPartitions, kafka.PartitionsDefault)
	cfg.SessionTimeout = cmp.Or(cfg.SessionTimeout, kafka.SessionTimeoutDefault)
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
	if len(cfg.Brokers) == 0 {
		bad("no Brokers")
	}
	if cfg.Group == "" {
		bad("no Group")
	}
	if len(cfg.Topics) == 0 {
		bad("no Topics")
	}
	seen := map[string]bool{}
	for _, t := range cfg.Topics {
		switch {
		case t == "":
			bad("empty topic name")
		case strings.HasSuffix(t, RetrySuffix), strings.HasSuffix(t, DLQSuffix):
			bad("topic %q: list domain topics; their %s and %s topics are derived", t, RetrySuffix, DLQSuffix)
		case seen[t]:
			bad("topic %q listed twice", t)
		case kafka.CheckTopic(t+RetrySuffix) != nil:
			bad("%v (with its %s suffix)", kafka.CheckTopic(t+RetrySuffix), RetrySuffix)
		}
		seen[t] = true
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
	if cfg.MaxAttempts < 1 {
		bad("MaxAttempts %d < 1", cfg.MaxAttempts)
	}
	for name, d := range map[string]time.Duration{"Backoff": cfg.Backoff, "BackoffMax": cfg.BackoffMax, "CommitInterval": cfg.CommitInterval, "ShutdownTimeout": cfg.ShutdownTimeout, "SessionTimeout": cfg.SessionTimeout} {
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
	if cfg.MaxHeld < 1 {
		bad("MaxHeld %d < 1", cfg.MaxHeld)
	}
	if cfg.TopicPartitions < 1 {
		bad("TopicPartitions %d < 1", cfg.TopicPartitions)
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrConfig, errors.Join(errs...))
	}
	return nil
}
