package amqp

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/transport"
)

// Headers km0 adds on RabbitMQ (Kafka has native equivalents or does not
// need them).
const (
	// HeaderKey carries transport.Message.Key (agregat_id): AMQP messages
	// have no key of their own.
	HeaderKey = "clau"
	// HeaderOriginQueue names the queue a dead letter km0 published itself
	// (exhausted retries) came from; native dead letters have x-death.
	HeaderOriginQueue = "cua_origen"
)

// ContentTypeJSON is the content type of km0 envelopes.
const ContentTypeJSON = "application/json"

// toPublishing converts m. The envelope id (header id_esdeveniment) becomes
// the AMQP message_id and tipus the AMQP type, so that tools that only show
// properties still identify the event; a message without an id gets a random
// message_id (Publisher matches basic.return frames by message_id).
func toPublishing(m *transport.Message, contentType string) amqp.Publishing {
	headers := make(amqp.Table, len(m.Headers)+1)
	for _, h := range m.Headers {
		headers[h.Key] = h.Value
	}
	if len(m.Key) > 0 {
		headers[HeaderKey] = string(m.Key)
	}
	id, _ := m.Header(contract.HeaderEventID)
	if id == "" {
		id = uuid.NewString()
	}
	typ, _ := m.Header(contract.HeaderType)
	return amqp.Publishing{
		Headers:      headers,
		ContentType:  contentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    id,
		Type:         typ,
		Timestamp:    time.Now(),
		Body:         m.Value,
	}
}

// FromDelivery converts a delivery to a transport.Message: Topic is the
// routing key it was published with, Key comes from the clau header, and
// every header with a scalar value becomes a string header (tables and
// arrays, such as x-death, are left out; read them from the Delivery).
func FromDelivery(d *amqp.Delivery) *transport.Message {
	m := &transport.Message{Topic: d.RoutingKey, Value: d.Body}
	for k, v := range d.Headers {
		s, ok := headerString(v)
		if !ok {
			continue
		}
		if k == HeaderKey {
			m.Key = []byte(s)
			continue
		}
		m.Headers = append(m.Headers, transport.Header{Key: k, Value: s})
	}
	return m
}

// headerString renders a scalar header value; false for tables and arrays.
func headerString(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case []byte:
		return string(x), true
	case bool:
		return strconv.FormatBool(x), true
	case int, int8, int16, int32, int64, uint8, uint16, uint32, uint64:
		return fmt.Sprint(x), true
	case float32:
		return strconv.FormatFloat(float64(x), 'f', -1, 32), true
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64), true
	case time.Time:
		return x.UTC().Format(time.RFC3339), true
	case nil:
		return "", true
	default:
		return "", false
	}
}

// headerInt reads an integer header written by km0 or by another client
// (which may send it as a string or as any AMQP integer type). Missing or
// unreadable is 0.
func headerInt(t amqp.Table, key string) int64 {
	switch x := t[key].(type) {
	case int:
		return int64(x)
	case int8:
		return int64(x)
	case int16:
		return int64(x)
	case int32:
		return int64(x)
	case int64:
		return x
	case uint8:
		return int64(x)
	case uint16:
		return int64(x)
	case uint32:
		return int64(x)
	case float64:
		return int64(x)
	case string:
		n, _ := strconv.ParseInt(strings.TrimSpace(x), 10, 64)
		return n
	default:
		return 0
	}
}

// headerTime reads a time header written by km0 or by another client: a
// decimal string (contract.ParseTime: unix seconds, or the milliseconds
// km0 wrote before), any AMQP number of the same, or an AMQP timestamp.
// ok is false when it is missing or names no time.
func headerTime(t amqp.Table, key string) (time.Time, bool) {
	switch x := t[key].(type) {
	case nil:
		return time.Time{}, false
	case time.Time:
		return x, !x.IsZero()
	default:
		s, ok := headerString(x)
		if !ok {
			return time.Time{}, false
		}
		ts, err := contract.ParseTime(s)
		return ts, err == nil
	}
}

// XDeath is one entry of the x-death header RabbitMQ adds when it
// dead-letters a message (most recent first).
type XDeath struct {
	Queue    string
	Reason   string // rejected, expired, maxlen, delivery_limit
	Count    int64
	Time     time.Time
	Exchange string
}

// XDeaths decodes the x-death header of t (nil when absent).
func XDeaths(t amqp.Table) []XDeath {
	arr, _ := t["x-death"].([]any)
	out := make([]XDeath, 0, len(arr))
	for _, e := range arr {
		tbl, ok := e.(amqp.Table)
		if !ok {
			continue
		}
		xd := XDeath{Count: headerInt(tbl, "count")}
		xd.Queue, _ = tbl["queue"].(string)
		xd.Reason, _ = tbl["reason"].(string)
		xd.Exchange, _ = tbl["exchange"].(string)
		xd.Time, _ = tbl["time"].(time.Time)
		out = append(out, xd)
	}
	return out
}

// copyHeaders returns a copy of t without the headers RabbitMQ owns (x-*)
// and without drop, so that a republished message starts a clean history.
func copyHeaders(t amqp.Table, drop ...string) amqp.Table {
	out := make(amqp.Table, len(t)+4)
	for k, v := range t {
		if strings.HasPrefix(k, "x-") {
			continue
		}
		out[k] = v
	}
	for _, k := range drop {
		delete(out, k)
	}
	return out
}

// republish returns the Publishing that carries d again with headers h.
func republish(d *amqp.Delivery, h amqp.Table) amqp.Publishing {
	return amqp.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// maxShortStr is the length limit of an AMQP short string.
const maxShortStr = 255

// checkShortStrings reports the first field of a publish that AMQP encodes as
// a short string (exchange, routing key, the string properties, header names
// at any depth) and that is longer than 255 bytes. amqp091-go finds it only
// while writing the frame and then shuts the whole connection down, so it
// must be caught before the publish.
func checkShortStrings(exchange, key string, p *amqp.Publishing) error {
	for _, f := range [...]struct{ name, v string }{
		{"exchange", exchange}, {"routing key", key}, {"content_type", p.ContentType},
		{"content_encoding", p.ContentEncoding}, {"correlation_id", p.CorrelationId}, {"reply_to", p.ReplyTo},
		{"expiration", p.Expiration}, {"message_id", p.MessageId}, {"type", p.Type}, {"user_id", p.UserId},
		{"app_id", p.AppId},
	} {
		if len(f.v) > maxShortStr {
			return shortStrError(f.name, f.v)
		}
	}
	return checkTableNames(p.Headers)
}

func checkTableNames(t amqp.Table) error {
	for k, v := range t {
		if len(k) > maxShortStr {
			return shortStrError("header name", k)
		}
		if err := checkFieldNames(v); err != nil {
			return err
		}
	}
	return nil
}

func checkFieldNames(v any) error {
	switch x := v.(type) {
	case amqp.Table:
		return checkTableNames(x)
	case []any:
		for _, e := range x {
			if err := checkFieldNames(e); err != nil {
				return err
			}
		}
	}
	return nil
}

func shortStrError(field, v string) error {
	return fmt.Errorf("amqp: %s of %d bytes (%q…) is over AMQP's limit of %d", field, len(v), v[:32], maxShortStr)
}
