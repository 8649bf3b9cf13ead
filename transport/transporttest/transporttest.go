// Package transporttest is the conformance suite every transport.Publisher
// runs (like Watermill's pubsub tests): the same proofs of
// transport.Publisher's contract, against the real broker, for
// transport/kafka and transport/amqp.
//
// The contract: Publish returns nil only when the broker confirmed every
// message; a *transport.RejectedError names the messages refused for good
// when every other one was confirmed; any other error claims nothing about
// any message, and publishing them all again is safe (at-least-once).
//
// A harness runs against the machine's broker (or kfake) by default and
// against an external one when KM0_TEST_KAFKA_BROKERS or KM0_TEST_AMQP_URL
// names it; see docs/contract.md.
package transporttest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/tracing"
	"github.com/km0/km0/transport"
)

// MaxBytes is the largest value a harness's destination accepts: a larger
// message is refused for good. Harnesses set the broker or publisher limit to
// it (Kafka: the topic's max.message.bytes; RabbitMQ: the publisher's
// MaxMessageBytes).
const MaxBytes = 10_000

// Features says what a broker does; a case whose feature is off is skipped
// with the reason.
type Features struct {
	// HeaderOrder: headers arrive in the order given, repeated names
	// included (Kafka record headers). Off: headers are a set of distinct
	// names (an AMQP table).
	HeaderOrder bool
	// Unroutable: the broker can refuse a message because its destination
	// does not exist (RabbitMQ mandatory publish with no binding; Kafka with
	// auto.create.topics.enable=false). Off when the broker creates
	// destinations on first use.
	Unroutable bool
	// NoUnroutable says why Unroutable is off.
	NoUnroutable string
}

// Target is a publisher, reaching the broker through a Gate, and a fresh
// destination on that broker.
type Target struct {
	Publisher transport.Publisher
	// Topic is the Message.Topic that reaches the destination (the Kafka
	// topic, or the AMQP routing key of a bound queue).
	Topic string
	// Create makes the destination of topic exist (Kafka: a topic; AMQP: a
	// queue bound for it), with values over MaxBytes refused; it is removed
	// at the test's cleanup.
	Create func(topic string)
	// Read returns the messages delivered to topic's destination since the
	// previous Read of it, waiting until there are at least n or timeout
	// passed. It reads past the Gate.
	Read func(topic string, n int, timeout time.Duration) []*transport.Message
}

// Harness is one broker under test.
type Harness struct {
	Features Features
	// New returns a Target whose publisher dials the broker through gate
	// and whose Topic already exists. Everything it creates goes at the
	// test's cleanup.
	New func(t *testing.T, gate *Gate) Target
}

// Run runs every proof as a subtest.
func Run(t *testing.T, h Harness) {
	cases := []struct {
		name string
		fn   func(t *testing.T, h Harness)
	}{
		{"EmptyCallIsNil", emptyCall},
		{"NilMeansEveryMessageWasConfirmedOnce", confirmsEvery},
		{"OrderPerKeyIsKept", orderPerKey},
		{"HeadersKeyAndValueRoundTripByteExact", headersRoundTrip},
		{"CallersTraceTravelsAndTheCallersMessagesAreUntouched", trace_},
		{"ConcurrentCallsEachGetTheirOwnOutcome", concurrent},
		{"OversizedMessageIsRejectedForGoodAndTheOthersConfirmed", oversized},
		{"MessagesThatFitAreNeverRejected", fitNeverRejected},
		{"RejectedErrorListsEveryRefusedIndexInOrder", batchRejected},
		{"UnroutableIsNotRejectedAndHealsWhenTheDestinationExists", unroutable},
		{"BrokerDownIsAnErrorThatClaimsNothing", brokerDown},
		{"ContextEndUnblocksAPublishThatCannotComplete", contextCancel},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.fn(t, h)
		})
	}
}

const readTimeout = 10 * time.Second

// msg returns a message for topic with key and a value naming seq.
func msg(topic, key string, seq int) *transport.Message {
	id := fmt.Sprintf("ev-%s-%d", key, seq)
	return &transport.Message{Topic: topic, Key: []byte(key), Value: []byte(strconv.Itoa(seq)),
		Headers: []transport.Header{{Key: contract.HeaderType, Value: "prova.feta"}, {Key: contract.HeaderEventID, Value: id}}}
}

// values counts the delivered messages by value.
func values(ms []*transport.Message) map[string]int {
	out := map[string]int{}
	for _, m := range ms {
		out[string(m.Value)]++
	}
	return out
}

// notRejected fails unless err is an error that claims nothing.
func notRejected(t *testing.T, err error, what string) {
	t.Helper()
	var rej *transport.RejectedError
	switch {
	case err == nil:
		t.Fatalf("%s: Publish returned nil", what)
	case errors.As(err, &rej):
		t.Fatalf("%s: Publish returned a *RejectedError (it claims the others were confirmed): %v", what, err)
	}
}

// incompressible returns n random bytes: a repeated byte would compress under
// a broker's limit.
func incompressible(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func emptyCall(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	if err := tg.Publisher.Publish(context.Background(), nil); err != nil {
		t.Fatalf("Publish(nil): %v", err)
	}
	if err := tg.Publisher.Publish(context.Background(), []*transport.Message{}); err != nil {
		t.Fatalf("Publish(empty): %v", err)
	}
	// Something sent afterwards is the only thing there.
	if err := tg.Publisher.Publish(context.Background(), []*transport.Message{msg(tg.Topic, "a", 0)}); err != nil {
		t.Fatal(err)
	}
	if got := tg.Read(tg.Topic, 1, readTimeout); len(got) != 1 || string(got[0].Value) != "0" {
		t.Fatalf("delivered %d messages, want the 1 sent after the empty calls", len(got))
	}
}

// nil means every message of the call is on the broker, each once.
func confirmsEvery(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	const n = 300
	msgs := make([]*transport.Message, n)
	for i := range msgs {
		msgs[i] = msg(tg.Topic, fmt.Sprintf("K%d", i%7), i)
	}
	if err := tg.Publisher.Publish(context.Background(), msgs); err != nil {
		t.Fatal(err)
	}
	got := values(tg.Read(tg.Topic, n, readTimeout))
	for i := range n {
		if c := got[strconv.Itoa(i)]; c != 1 {
			t.Fatalf("message %d delivered %d times, want 1 (%d distinct of %d)", i, c, len(got), n)
		}
	}
	if len(got) != n {
		t.Fatalf("%d distinct messages delivered, want %d", len(got), n)
	}
}

// Messages of one key, in one call and across calls, arrive in the order
// they were given.
func orderPerKey(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	keys := []string{"A", "B", "C", "D"}
	seq := 0
	for range 3 {
		var msgs []*transport.Message
		for i := range 100 {
			msgs = append(msgs, msg(tg.Topic, keys[i%len(keys)], seq))
			seq++
		}
		if err := tg.Publisher.Publish(context.Background(), msgs); err != nil {
			t.Fatal(err)
		}
	}
	got := tg.Read(tg.Topic, seq, readTimeout)
	if len(got) != seq {
		t.Fatalf("delivered %d, want %d", len(got), seq)
	}
	last := map[string]int{}
	for _, m := range got {
		v, _ := strconv.Atoi(string(m.Value))
		if prev, ok := last[string(m.Key)]; ok && v <= prev {
			t.Fatalf("key %s: %d delivered after %d", m.Key, v, prev)
		}
		last[string(m.Key)] = v
	}
}

// Header values and keys arrive byte for byte: empty, non-ASCII, not UTF-8,
// NUL bytes, long.
func headersRoundTrip(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	headers := []transport.Header{
		{Key: contract.HeaderType, Value: "prova.feta"},
		{Key: contract.HeaderEventID, Value: "0b9a8e5e-7f3c-4c1e-9d2a-5b1f0e6c7a01"},
		{Key: "buit", Value: ""},
		{Key: "accents", Value: "çàèéíòóú·l€ 😀"},
		{Key: "binari", Value: "\xff\xfe\x00\x01\x80"},
		{Key: "llarg", Value: strings.Repeat("x", 2000)},
		{Key: contract.HeaderAttempts, Value: "3"},
	}
	if h.Features.HeaderOrder {
		headers = append(headers, transport.Header{Key: "repetit", Value: "1"}, transport.Header{Key: "repetit", Value: "2"})
	}
	key := []byte("clau-\xff\x00-ç")
	value := []byte("{\"dades\":\"\xff\"}\x00")
	m := &transport.Message{Topic: tg.Topic, Key: key, Value: value, Headers: headers}
	if err := tg.Publisher.Publish(context.Background(), []*transport.Message{m}); err != nil {
		t.Fatal(err)
	}
	got := tg.Read(tg.Topic, 1, readTimeout)
	if len(got) != 1 {
		t.Fatalf("delivered %d, want 1", len(got))
	}
	if !bytes.Equal(got[0].Key, key) || !bytes.Equal(got[0].Value, value) {
		t.Fatalf("key %q value %q, want %q %q", got[0].Key, got[0].Value, key, value)
	}
	want, have := slices.Clone(headers), slices.Clone(got[0].Headers)
	if !h.Features.HeaderOrder {
		byKey := func(a, b transport.Header) int { return strings.Compare(a.Key, b.Key) }
		slices.SortFunc(want, byKey)
		slices.SortFunc(have, byKey)
	}
	if !slices.Equal(want, have) {
		t.Fatalf("headers\n got %q\nwant %q", have, want)
	}
}

// The trace of ctx reaches the consumer in the headers of what is sent, and
// Publish writes nothing into the caller's messages.
func trace_(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
	m := msg(tg.Topic, "k", 1)
	before := slices.Clone(m.Headers)
	if err := tg.Publisher.Publish(ctx, []*transport.Message{m}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(m.Headers, before) {
		t.Fatalf("Publish wrote into the caller's message: %v", m.Headers)
	}
	got := tg.Read(tg.Topic, 1, readTimeout)
	if len(got) != 1 {
		t.Fatalf("delivered %d, want 1", len(got))
	}
	if sc := trace.SpanContextFromContext(tracing.Extract(context.Background(), got[0])); sc.TraceID() != tid {
		t.Fatalf("consumer side trace %v, want %v", sc.TraceID(), tid)
	}
}

// Calls from many goroutines on one publisher each wait for their own
// confirms; every message is delivered once.
func concurrent(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	const goroutines, calls, each = 8, 10, 5
	var wg sync.WaitGroup
	errs := make(chan error, goroutines*calls)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c := range calls {
				var msgs []*transport.Message
				for i := range each {
					msgs = append(msgs, msg(tg.Topic, fmt.Sprintf("g%d", g), (g*calls+c)*each+i))
				}
				if err := tg.Publisher.Publish(context.Background(), msgs); err != nil {
					errs <- fmt.Errorf("goroutine %d call %d: %w", g, c, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	const n = goroutines * calls * each
	got := values(tg.Read(tg.Topic, n, readTimeout))
	if len(got) != n {
		t.Fatalf("%d distinct messages delivered, want %d", len(got), n)
	}
	for v, c := range got {
		if c != 1 {
			t.Fatalf("message %s delivered %d times", v, c)
		}
	}
}

// A message over the limit is refused for good, named by its index, and
// every other message of the call is confirmed; the publisher keeps working.
func oversized(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	big := msg(tg.Topic, "b", 1)
	big.Value = incompressible(5 * MaxBytes)
	err := tg.Publisher.Publish(context.Background(), []*transport.Message{msg(tg.Topic, "a", 0), big, msg(tg.Topic, "c", 2)})
	var rej *transport.RejectedError
	if !errors.As(err, &rej) || fmt.Sprint(rej.Index) != "[1]" || len(rej.Errs) != 1 || rej.Errs[0] == nil {
		t.Fatalf("want message 1 rejected for good with its reason, got %v", err)
	}
	got := values(tg.Read(tg.Topic, 2, readTimeout))
	if len(got) != 2 || got["0"] != 1 || got["2"] != 1 {
		t.Fatalf("the 2 good messages: delivered %v", got)
	}
	if err := tg.Publisher.Publish(context.Background(), []*transport.Message{msg(tg.Topic, "a", 3)}); err != nil {
		t.Fatalf("the next call after a rejection: %v", err)
	}
}

// Messages that each fit the limit are never rejected, even when together
// they are many times over it (a client batching them must not make them
// refusable).
func fitNeverRejected(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	var msgs []*transport.Message
	for i := range 40 {
		m := msg(tg.Topic, "a", i)
		m.Value = append([]byte(strconv.Itoa(i)+":"), incompressible(MaxBytes/5)...)
		msgs = append(msgs, m)
	}
	if err := tg.Publisher.Publish(context.Background(), msgs); err != nil {
		t.Fatalf("40 messages of %d bytes under a %d-byte limit: %v", MaxBytes/5, MaxBytes, err)
	}
	if got := tg.Read(tg.Topic, 40, readTimeout); len(got) != 40 {
		t.Fatalf("delivered %d, want 40", len(got))
	}
}

// Several refused messages: Index lists each, ascending, with a reason for
// each; everything else was confirmed.
func batchRejected(t *testing.T, h Harness) {
	tg := h.New(t, NewGate())
	var msgs []*transport.Message
	for i := range 6 {
		m := msg(tg.Topic, fmt.Sprintf("k%d", i%2), i)
		if i == 0 || i == 3 || i == 4 {
			m.Value = append([]byte(strconv.Itoa(i)), incompressible(2*MaxBytes)...)
		}
		msgs = append(msgs, m)
	}
	err := tg.Publisher.Publish(context.Background(), msgs)
	var rej *transport.RejectedError
	if !errors.As(err, &rej) || fmt.Sprint(rej.Index) != "[0 3 4]" || len(rej.Errs) != 3 {
		t.Fatalf("want messages [0 3 4] rejected for good, got %v", err)
	}
	for i, e := range rej.Errs {
		if e == nil {
			t.Fatalf("rejection %d has no reason", i)
		}
	}
	got := values(tg.Read(tg.Topic, 3, readTimeout))
	if len(got) != 3 || got["1"] != 1 || got["2"] != 1 || got["5"] != 1 {
		t.Fatalf("the 3 good messages: delivered %v", got)
	}
}

// A message whose destination does not exist is not refused for good (the
// gap heals when the destination is created): the call fails with an error
// that is no *RejectedError, and the same call, made again once the
// destination exists, is confirmed.
func unroutable(t *testing.T, h Harness) {
	if !h.Features.Unroutable {
		t.Skip(h.Features.NoUnroutable)
	}
	tg := h.New(t, NewGate())
	missing := tg.Topic + ".encara-no"
	msgs := []*transport.Message{msg(tg.Topic, "a", 0), msg(missing, "b", 1), msg(tg.Topic, "c", 2)}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	notRejected(t, tg.Publisher.Publish(ctx, msgs), "a message to a destination that does not exist")
	tg.Create(missing)
	if err := tg.Publisher.Publish(context.Background(), msgs); err != nil {
		t.Fatalf("the same call once the destination exists: %v", err)
	}
	if got := tg.Read(missing, 1, readTimeout); len(got) != 1 || string(got[0].Value) != "1" {
		t.Fatalf("the new destination holds %d messages, want message 1", len(got))
	}
	// At-least-once: the first call may have delivered the routable ones.
	got := values(tg.Read(tg.Topic, 2, readTimeout))
	if got["0"] < 1 || got["2"] < 1 {
		t.Fatalf("the routable messages: delivered %v", got)
	}
}

// While the broker is unreachable Publish returns an error that claims
// nothing; once it is back, publishing the same messages again is
// confirmed and delivers every one.
func brokerDown(t *testing.T, h Harness) {
	gate := NewGate()
	tg := h.New(t, gate)
	warm := msg(tg.Topic, "a", 0) // the publisher is connected before the outage
	if err := tg.Publisher.Publish(context.Background(), []*transport.Message{warm}); err != nil {
		t.Fatal(err)
	}
	gate.Down()
	msgs := []*transport.Message{msg(tg.Topic, "a", 1), msg(tg.Topic, "b", 2), msg(tg.Topic, "a", 3)}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	err := publishWithin(t, tg.Publisher, ctx, msgs, 10*time.Second)
	cancel()
	notRejected(t, err, "broker unreachable")
	gate.Up()
	// A caller publishes again until confirmed; each failure on the way
	// (a connection found dead only now) must claim nothing either.
	deadline := time.Now().Add(30 * time.Second)
	for try := 1; ; try++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := publishWithin(t, tg.Publisher, ctx, msgs, 10*time.Second)
		cancel()
		if err == nil {
			t.Logf("confirmed at attempt %d after the outage", try)
			break
		}
		notRejected(t, err, "publishing again after the outage")
		if time.Now().After(deadline) {
			t.Fatalf("still failing 30 s after the broker came back (%d attempts): %v", try, err)
		}
		time.Sleep(50 * time.Millisecond) // the caller's retry backoff
	}
	// Copies of a retried call may fill the first reads: read on until every
	// message is there or no more comes within readTimeout.
	all := func(got map[string]int) bool { return got["0"] > 0 && got["1"] > 0 && got["2"] > 0 && got["3"] > 0 }
	recs := tg.Read(tg.Topic, 4, readTimeout)
	for got := values(recs); !all(got); got = values(recs) {
		more := tg.Read(tg.Topic, len(recs)+1, readTimeout)
		if len(more) <= len(recs) {
			t.Fatalf("a message lost across the outage: delivered %v, want 0, 1, 2 and 3", got)
		}
		recs = more
	}
}

// A call that cannot complete (the broker is unreachable) returns soon after
// its context ends, with an error wrapping the context's, claiming nothing.
func contextCancel(t *testing.T, h Harness) {
	gate := NewGate()
	tg := h.New(t, gate)
	if err := tg.Publisher.Publish(context.Background(), []*transport.Message{msg(tg.Topic, "a", 0)}); err != nil {
		t.Fatal(err)
	}
	gate.Down()
	defer gate.Up()
	// A call may fail at once while the publisher finds its connection
	// dead (that error claims nothing either); once it knows, a call can
	// only wait, and the end of its context must end the wait.
	for try := 0; ; try++ {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		err := publishWithin(t, tg.Publisher, ctx, []*transport.Message{msg(tg.Topic, "a", 1)}, 10*time.Second)
		cancel()
		notRejected(t, err, "broker unreachable")
		if errors.Is(err, context.DeadlineExceeded) {
			break
		}
		if try == 50 {
			t.Fatalf("50 calls with the broker unreachable failed at once; the last: %v", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(200*time.Millisecond, cancel)
	err := publishWithin(t, tg.Publisher, ctx, []*transport.Message{msg(tg.Topic, "a", 1), msg(tg.Topic, "b", 2)}, 10*time.Second)
	notRejected(t, err, "context cancelled")
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("error %v does not wrap context.Canceled", err)
	}
}

// publishWithin is Publish, failing the test if it has not returned after
// limit (a publisher that ignores the end of ctx would hang the suite).
func publishWithin(t *testing.T, p transport.Publisher, ctx context.Context, msgs []*transport.Message, limit time.Duration) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- p.Publish(ctx, msgs) }()
	select {
	case err := <-done:
		return err
	case <-time.After(limit):
		t.Fatalf("Publish still blocked %v after it began, its context long over", limit)
		return nil
	}
}
