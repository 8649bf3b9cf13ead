// Package transport holds the small interfaces that keep the patterns (relay,
// consumers, request/reply) independent of the broker. Implementations live in
// transport/kafka and transport/amqp.
package transport

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// Header is one message header.
type Header struct {
	Key   string
	Value string
}

// Message is one message to publish or one delivered message.
type Message struct {
	// Topic is the Kafka topic, or for AMQP the routing key (see transport/amqp).
	Topic   string
	Key     []byte // partition key: agregat_id
	Value   []byte // the encoded envelope
	Headers []Header
}

// Header returns the value of the first header named key, and whether it exists.
func (m *Message) Header(key string) (string, bool) {
	for _, h := range m.Headers {
		if h.Key == key {
			return h.Value, true
		}
	}
	return "", false
}

// SetHeader replaces or adds a header.
func (m *Message) SetHeader(key, value string) {
	for i := range m.Headers {
		if m.Headers[i].Key == key {
			m.Headers[i].Value = value
			return
		}
	}
	m.Headers = append(m.Headers, Header{Key: key, Value: value})
}

// Publisher publishes messages with confirmation.
//
// Publish returns nil only when the broker has confirmed every message
// (Kafka acks=all, AMQP publisher confirms). If some messages were refused for
// good (they can never be accepted, e.g. over the broker's size limit) and all
// the others were confirmed, it returns a *RejectedError naming them. Any other
// error means nothing is known about any message of the call: the caller must
// treat all of them as unpublished and may publish them again (at-least-once).
type Publisher interface {
	Publish(ctx context.Context, msgs []*Message) error
}

// Checker is implemented by a Publisher that can tell, before sending, that
// its broker would refuse a message for good (too large, a field over a
// protocol limit). Check returns the reason, or nil. The relay calls it
// while building a chunk, so that a row the broker would refuse is parked
// before any later row of its aggregate is sent.
type Checker interface {
	Check(m *Message) error
}

// RejectedError lists the messages of one Publish call the broker refused for
// good; every other message of the call was confirmed.
type RejectedError struct {
	Index []int   // positions in the msgs slice
	Errs  []error // the broker's reason for each
}

func (e *RejectedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "transport: %d message(s) rejected for good", len(e.Index))
	for i := range e.Index {
		if i == 3 {
			b.WriteString("; …")
			break
		}
		fmt.Fprintf(&b, "; #%d: %v", e.Index[i], e.Errs[i])
	}
	return b.String()
}

// ErrClosed is returned by a closed transport.
var ErrClosed = errors.New("transport: closed")
