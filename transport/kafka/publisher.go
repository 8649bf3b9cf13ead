// Package kafka is km0's Kafka transport, on franz-go: a confirmed Publisher,
// the client options km0 relies on, topic management, and the embedded broker
// (kfake) used by tests, `km0 kafka` and `km0 demo`.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
)

// Publisher publishes to Kafka and waits for every record's acknowledgement
// (acks=all, idempotent producer: both are franz-go's defaults and ClientOpts
// keeps them).
type Publisher struct {
	cl *kgo.Client
}

// NewPublisher wraps a client. The caller keeps ownership of cl.
func NewPublisher(cl *kgo.Client) *Publisher { return &Publisher{cl: cl} }

// Publish implements transport.Publisher. Records of one key keep their order
// (same partition, idempotent producer, in-order retries). A record refused
// as too large is produced again alone before it is reported in a
// *transport.RejectedError: the client may have batched records that each fit
// the topic's limit into one that does not. Such a record is then confirmed
// after the later records of its partition in this call; a client whose
// ProducerBatchMaxBytes is at most the topic's limit never needs this.
func (p *Publisher) Publish(ctx context.Context, msgs []*transport.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		refused  []int // refused for good, maybe only as part of a batch
		firstErr error
	)
	traced := trace.SpanContextFromContext(ctx).IsValid()
	recs := make([]*kgo.Record, len(msgs))
	wg.Add(len(msgs))
	for i, m := range msgs {
		if traced {
			// Carry the caller's trace to the consumer, without writing
			// into the caller's message.
			c := *m
			c.Headers = slices.Clone(m.Headers)
			tracing.Inject(ctx, &c)
			m = &c
		}
		recs[i] = toRecord(m)
		p.cl.Produce(ctx, recs[i], func(_ *kgo.Record, err error) {
			defer wg.Done()
			if err == nil {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if IsRejectedForGood(err) {
				refused = append(refused, i)
				return
			}
			if firstErr == nil {
				firstErr = err
			}
		})
	}
	// The client fails buffered records when ctx ends only while it is safe
	// for the idempotent producer, which it is not while the broker is
	// unreachable: stop waiting at the end of ctx. The records may still be
	// delivered later; the caller knows nothing of them, as the contract says.
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		return fmt.Errorf("kafka: waiting for acknowledgements: %w", ctx.Err())
	}
	mu.Lock()
	defer mu.Unlock()
	if firstErr != nil {
		return firstErr
	}
	if len(refused) == 0 {
		return nil
	}
	// The broker judges a batch, not a record: MESSAGE_TOO_LARGE fails every
	// record the client put in a batch over the topic's limit, each of which
	// may fit on its own. Produce each refused record again alone, in order;
	// only a record refused on its own is refused for good.
	slices.Sort(refused)
	var rejected *transport.RejectedError
	for _, i := range refused {
		r := recs[i]
		err := p.cl.ProduceSync(ctx, &kgo.Record{Topic: r.Topic, Key: r.Key, Value: r.Value, Headers: r.Headers}).FirstErr()
		switch {
		case err == nil:
		case IsRejectedForGood(err):
			if rejected == nil {
				rejected = &transport.RejectedError{}
			}
			rejected.Index = append(rejected.Index, i)
			rejected.Errs = append(rejected.Errs, err)
		default:
			return err
		}
	}
	if rejected != nil {
		return rejected
	}
	return nil
}

// toRecord converts without copying the byte slices.
func toRecord(m *transport.Message) *kgo.Record {
	r := &kgo.Record{Topic: m.Topic, Key: m.Key, Value: m.Value}
	if len(m.Headers) > 0 {
		r.Headers = make([]kgo.RecordHeader, len(m.Headers))
		for i, h := range m.Headers {
			r.Headers[i] = kgo.RecordHeader{Key: h.Key, Value: []byte(h.Value)}
		}
	}
	return r
}

// FromRecord converts a fetched record to a transport.Message (sharing bytes).
func FromRecord(r *kgo.Record) *transport.Message {
	m := &transport.Message{Topic: r.Topic, Key: r.Key, Value: r.Value}
	if len(r.Headers) > 0 {
		m.Headers = make([]transport.Header, len(r.Headers))
		for i, h := range r.Headers {
			m.Headers[i] = transport.Header{Key: h.Key, Value: string(h.Value)}
		}
	}
	return m
}

// IsRejectedForGood reports whether a produce error can never succeed for this
// record, however often it is retried: the record itself is the problem.
func IsRejectedForGood(err error) bool {
	return errors.Is(err, kerr.MessageTooLarge) ||
		errors.Is(err, kerr.RecordListTooLarge) ||
		errors.Is(err, kerr.InvalidRecord) ||
		errors.Is(err, kerr.CorruptMessage)
}
