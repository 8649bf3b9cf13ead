package consumer

import (
	"cmp"
	"context"

	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/tracing"
)

// Tracing: the consumer continues the trace each message carries. These two
// functions are the only places the consumer starts spans; the handler calls
// (call, callBatch, callBatchOutcomes in batch.go) wrap themselves in them.

// startSpan starts m's consumer span, the child of the trace context in its
// headers, and returns the handler's ctx.
func (c *Consumer) startSpan(ctx context.Context, m *Message) (context.Context, trace.Span) {
	n := c.cfg.Source.Span(m.Topic, m.OriginalTopic)
	d := tracing.Delivery{System: n.System, Destination: n.Destination, Group: cmp.Or(n.Group, c.cfg.Name),
		RoutingKey: n.RoutingKey, MessageID: m.Envelope.ID, Partition: m.Partition, Offset: m.Offset}
	ctx, span := tracing.ConsumerContext(ctx, m.Message, d)
	m.SetContext(ctx)
	return ctx, span
}

// startBatchSpans starts one consumer span per message (each the child of
// its own producer's trace: Message.Context) and returns the batch handler's
// ctx: that of the only message, or a batch span linked to every message's
// span. end ends them all, each message's span with its outcome (outcomes[i],
// or err for all when the whole batch failed).
func (c *Consumer) startBatchSpans(ctx context.Context, msgs []*Message) (context.Context, func(outcomes []error, err error)) {
	spans := make([]trace.Span, len(msgs))
	links := make([]trace.SpanContext, len(msgs))
	var mctx context.Context
	for i, m := range msgs {
		mctx, spans[i] = c.startSpan(ctx, m)
		links[i] = spans[i].SpanContext()
	}
	var batch trace.Span
	if len(msgs) == 1 {
		ctx = mctx
	} else {
		d := tracing.Delivery{System: c.cfg.Source.Span("", "").System /* the broker only */, Group: c.cfg.Source.Label(), Offset: -1}
		if len(msgs) > 0 { // one partition's messages
			d.Destination, d.Partition = msgs[0].Topic, msgs[0].Partition
		}
		ctx, batch = tracing.BatchContext(ctx, d, links)
	}
	return ctx, func(outcomes []error, err error) {
		for i, s := range spans {
			serr := err
			if serr == nil && i < len(outcomes) {
				serr = outcomes[i]
			}
			tracing.End(s, serr)
		}
		if batch != nil {
			tracing.End(batch, err)
		}
	}
}
