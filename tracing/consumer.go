package tracing

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/transport"
)

// ScopeName is the instrumentation scope of km0's spans.
const ScopeName = "github.com/km0/km0"

func tracer() trace.Tracer {
	return otel.GetTracerProvider().Tracer(ScopeName, trace.WithSchemaURL(semconv.SchemaURL))
}

// Messaging systems (semconv messaging.system).
const (
	SystemKafka    = "kafka"
	SystemRabbitMQ = "rabbitmq"
)

// Delivery describes one delivered message for its consumer span. Empty
// fields are left out of the span.
type Delivery struct {
	System      string // SystemKafka or SystemRabbitMQ
	Destination string // the topic (Kafka) or the queue (RabbitMQ) it was read from
	Group       string // the consumer group, or the consumidor on RabbitMQ
	MessageID   string // id_esdeveniment
	Partition   int32  // Kafka partition; with System SystemKafka only
	Offset      int64  // Kafka offset; with System SystemKafka only, left out when negative
	RoutingKey  string // RabbitMQ routing key
}

func (d Delivery) attributes(n int) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 0, n+8)
	attrs = append(attrs, semconv.MessagingSystemKey.String(d.System),
		semconv.MessagingOperationName("process"), semconv.MessagingOperationTypeProcess)
	if d.Destination != "" {
		attrs = append(attrs, semconv.MessagingDestinationName(d.Destination))
	}
	if d.Group != "" {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(d.Group))
	}
	if d.MessageID != "" {
		attrs = append(attrs, semconv.MessagingMessageID(d.MessageID))
	}
	if d.System == SystemKafka {
		attrs = append(attrs, semconv.MessagingDestinationPartitionID(strconv.Itoa(int(d.Partition))))
		if d.Offset >= 0 {
			attrs = append(attrs, semconv.MessagingKafkaOffset(int(d.Offset)))
		}
	}
	if d.RoutingKey != "" {
		attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(d.RoutingKey))
	}
	return attrs
}

// ConsumerContext continues the trace a message carries: it extracts the
// producer's trace context from m's headers (traceparent/tracestate, which
// the relay copied from the outbox row's capcaleres) and starts a consumer
// span "process <destination>" as its child, with the semantic-convention
// messaging attributes of d. The returned ctx carries that span: a handler's
// own spans, and the events it writes with outbox.Enqueue, join the trace.
// Without a traceparent the span starts a new trace. The caller ends the
// span with End. With no TracerProvider registered the span records nothing
// but still carries the producer's trace context, so propagation continues.
func ConsumerContext(ctx context.Context, m *transport.Message, d Delivery) (context.Context, trace.Span) {
	ctx = Extract(ctx, m)
	return tracer().Start(ctx, "process "+d.Destination,
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(d.attributes(0)...))
}

// BatchContext starts the span of a batch handler: "process <destination>"
// with messaging.batch.message_count, a new root linked to the consumer span
// of each message (links, not parents: one span cannot have several). Each
// message keeps its own consumer span (ConsumerContext), the child of its
// producer, so every message's trace stays whole; a batch handler writing
// events per message takes their context from the message (see
// consumer.Message.Context). The caller ends the span with End.
func BatchContext(ctx context.Context, d Delivery, msgs []trace.SpanContext) (context.Context, trace.Span) {
	links := make([]trace.Link, 0, len(msgs))
	for _, sc := range msgs {
		if sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	attrs := append(d.attributes(1), semconv.MessagingBatchMessageCount(len(msgs)))
	return tracer().Start(ctx, "process "+d.Destination, trace.WithNewRoot(), trace.WithLinks(links...),
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}

// End ends span, marking it failed with err when err is not nil.
func End(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// Headers returns ctx's trace context as the flat header map an outbox row
// stores in capcaleres (traceparent, tracestate and whatever else the global
// propagator writes), or nil when ctx carries neither a valid span context
// nor baggage: the common untraced path allocates nothing.
func Headers(ctx context.Context) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() && baggage.FromContext(ctx).Len() == 0 {
		return nil
	}
	c := mapCarrier{}
	propagator().Inject(ctx, &c)
	return c.m
}

// mapCarrier is a propagation.TextMapCarrier that allocates its map on the
// first Set only.
type mapCarrier struct{ m map[string]string }

func (c *mapCarrier) Get(key string) string { return c.m[key] }

func (c *mapCarrier) Set(key, value string) {
	if c.m == nil {
		c.m = make(map[string]string, 2)
	}
	c.m[key] = value
}

func (c *mapCarrier) Keys() []string {
	keys := make([]string, 0, len(c.m))
	for k := range c.m {
		keys = append(keys, k)
	}
	return keys
}
