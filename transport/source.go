package transport

import (
	"context"
	"log/slog"
	"time"

	"github.com/km0/km0/contract"
)

// Source is a broker's half of a consumer: it subscribes, hands deliveries
// to the pipeline (package consumer) in batches of one lane, and carries out
// what the pipeline decided for each (settle the ones that are done, copy
// the failures to a retry or dead-letter destination). Implementations:
// kafka.NewSource (consumer group, partitions, offsets, .retry/.dlq topics)
// and amqp.NewSource (work or shard queues, wait queues, the DLX).
//
// The guarantees of a consumer are the pipeline's; a source keeps to this
// contract:
//   - a delivery is settled (Kafka: its offset may be committed; RabbitMQ:
//     acked) only after Handle returned it done, or after the copy of its
//     Settlement is confirmed by the broker and Settled returned nil; in
//     AtMostOnce mode, before Handle instead;
//   - deliveries of one lane (a Kafka partition, a queue with one worker)
//     are handed over in their order, one batch at a time;
//   - once Pipeline.Crashed is closed, nothing more is settled.
type Source interface {
	// Run consumes until ctx is done, then lets the batches in hand finish
	// (within PipelineSettings.ShutdownTimeout), settles what they finished,
	// and returns nil; or returns an error wrapping the pipeline's crash
	// error once Crashed is closed. Run is called once.
	Run(ctx context.Context, p Pipeline) error
	// Label names the source in logs and metrics (label grup): the Kafka
	// consumer group, or the RabbitMQ work queue.
	Label() string
	// Validate reports what is wrong with the source's configuration, nil
	// when nothing is: consumer.New fails with it (wrapped in
	// consumer.ErrConfig) before anything connects.
	Validate() error
	// KeyOrder reports whether every message of one key reaches one lane,
	// in its order (consumer.PerKey relies on it): nil if so, else why not
	// (a RabbitMQ plain queue with several workers).
	KeyOrder() error
	// Span names a delivery in the consumer's trace span (OpenTelemetry
	// messaging attributes): topic is its Message.Topic (the Kafka topic it
	// was read from, the RabbitMQ routing key), origin its Delivery.Origin.
	Span(topic, origin string) SpanNames
}

// SpanNames are the messaging attributes of a consumer span, as the source
// of the delivery spells them (Source.Span).
type SpanNames struct {
	System      string // messaging.system: "kafka", "rabbitmq"
	Destination string // messaging.destination.name: the topic or the queue read
	// Group is messaging.consumer.group.name; "" names the consumer
	// (consumer.Config.Name), as on RabbitMQ, which has no groups.
	Group      string
	RoutingKey string // messaging.rabbitmq.destination.routing_key; "" on Kafka
}

// Pipeline is what a Source drives: the broker-neutral half of a consumer,
// implemented by package consumer.
type Pipeline interface {
	// Settings returns the consumer's configuration a source obeys.
	Settings() PipelineSettings
	// Handle runs the deliveries of b, of one lane and in its order, to
	// their outcomes. Every delivery not in the result is done: its effect
	// and key committed, a duplicate, or ignored. Each Settlement says what
	// the source must do with a failed one. An error means the consumer
	// crashed or the batch was abandoned (b.Stop closed, ctx done): the
	// source settles nothing of b, and the broker redelivers it.
	Handle(ctx context.Context, b *Batch) ([]*Settlement, error)
	// Settled reports settlements the source carried out (the broker
	// confirmed their copies; a native dead letter was sent): they are
	// counted, logged and observed (Config.OnDeadLetter). An error is a
	// crash injected right before the source settles the originals: the
	// source must settle nothing more.
	Settled(ctx context.Context, s []*Settlement) error
	// Foreign counts n retry copies of another consumer group that the
	// source settled without handling them, under origin.
	Foreign(origin string, n int)
	// Held adds delta to the retry copies a source holds in memory until
	// their no_abans (metric km0_consumer_retry_held).
	Held(delta int)
	// Lag reports that n records of a lane (a Kafka partition) are not done
	// yet: from the first one not finished up to the partition's high
	// watermark, fetched or not (metric km0_consumer_lag); oldest is the
	// broker timestamp of the first fetched record not finished, zero when
	// none is (metric km0_consumer_oldest_unprocessed_seconds). A source
	// reports it when it learns a new high watermark and when records
	// finish; a negative n says the lane is no longer this consumer's
	// (revoked, lost, stopped) and removes it. A source that cannot know it
	// never calls it.
	Lag(topic string, partition int32, n int64, oldest time.Time)
	// Crashed is closed when a fault injection killed the consumer; Err
	// returns the crash error then.
	Crashed() <-chan struct{}
	Err() error
}

// PipelineSettings are the consumer settings a Source obeys.
type PipelineSettings struct {
	BatchSize       int           // most deliveries of one lane in one Handle
	Concurrency     int           // transactions at once (also a source's worker bound)
	MaxAttempts     int           // attempts in all (contract.Attempt reads a copy within it)
	BackoffMax      time.Duration // longest wait of a retry copy (contract.NotBefore)
	AtMostOnce      bool          // settle each delivery before Handle
	ShutdownTimeout time.Duration // bound of Run's stop
	Logger          *slog.Logger
}

// Batch is deliveries of one lane, in order, handed to Pipeline.Handle.
type Batch struct {
	Deliveries []*Delivery
	// Stop, when closed, tells the pipeline that the source gave the lane
	// up (a Kafka partition revoked, the consumer stopping): a wait in place
	// (a database outage, a conflict rerun) ends and the batch is abandoned.
	// nil: never.
	Stop <-chan struct{}
}

// Delivery is one message a Source hands to the pipeline.
type Delivery struct {
	*Message            // topic or routing key, key, value, headers
	Origin    string    // the domain topic, or the work queue
	Partition int32     // Kafka partition; RabbitMQ shard (0 on a plain queue)
	Offset    int64     // Kafka offset; -1 on RabbitMQ
	Timestamp time.Time // the broker's timestamp; zero when unknown
	// Attempt is 1 for a first delivery, and for a retry copy the attempt
	// it is on (contract.Attempt of its intents).
	Attempt      int
	FirstFailure time.Time // a retry copy's primera_fallada; zero on attempt 1
	// Types are the delivery's tipus headers as the source read them, when
	// the broker can carry a header that is not text (an AMQP number); nil:
	// the pipeline reads the tipus headers of Message.
	Types *contract.TypeHeader
	// Ref is the source's own handle of the delivery (*kgo.Record,
	// *amqp091.Delivery); the pipeline never reads it.
	Ref any
}

// Settlement is the pipeline's decision for a failed delivery: a retry
// after NotBefore, or a dead letter with Reason. A source that cannot carry
// a retry out (its copy refused for good, its wait queue gone) makes it a
// dead letter instead (sets Dead and Reason) before it calls Settled, so the
// message is never lost and never loops.
type Settlement struct {
	D *Delivery
	// Dead: dead-letter it (else retry it). Permanent: the failure is
	// permanent (not attempts spent); a RabbitMQ source nacks such a
	// delivery natively to its DLX when it is still unacked.
	Dead, Permanent bool
	Reason          string        // motiu of a dead letter (≤ 200 bytes)
	NotBefore       time.Time     // a retry's earliest next attempt: the decision's time + Delay
	Delay           time.Duration // a retry's wait (a RabbitMQ wait queue is named by it)
	LastError       string        // ultim_error (≤ 200 bytes)
	Err             error         // the failure
	// Panic: the failure is a recovered panic (counted in Stats.Panics).
	Panic bool
	// Ref is the pipeline's own view of the message; a source leaves it
	// alone.
	Ref any
	// Copy, when set, is the message to copy in place of D's own. Per-key
	// order (consumer.PerKey) keeps messages in the pipeline's store: one
	// released from there that fails, or one dead-lettered as blocked by its
	// key's head, has no delivery of its own, so its Settlement names the
	// delivery in hand as D. The source copies Copy (its Message, Origin,
	// Partition, Offset, Timestamp, Attempt, FirstFailure; Ref nil), never
	// settles it natively (no nack to a DLX), and settles D once every copy
	// of the settlements that name D is confirmed. Several settlements may
	// name one D; D is settled once.
	Copy *Delivery
}

// Copied is what a source copies for s: s.Copy when set, else s.D.
func (s *Settlement) Copied() *Delivery {
	if s.Copy != nil {
		return s.Copy
	}
	return s.D
}
