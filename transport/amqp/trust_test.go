package amqp_test

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport/amqp"
)

// rawEvent is an envelope of tipus for publishRaw, with its id.
func rawEvent(t *testing.T, tipus string) (id string, body []byte) {
	t.Helper()
	e := &envelope.Envelope{ID: uuid.NewString(), Type: tipus, Version: 1, TimeMS: time.Now().UnixMilli(), Origin: "test",
		Data: []byte(`{"clau":"k","seq":1}`)}
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return e.ID, b
}

// publishRaw publishes body to queue through the default exchange with
// headers exactly as given (any AMQP field type), as another client or an
// older km0 may have written them.
func publishRaw(t *testing.T, b *bundle, id string, body []byte, h amqp091.Table) {
	t.Helper()
	if h["id_esdeveniment"] == nil {
		h["id_esdeveniment"] = id
	}
	err := b.conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		return ch.PublishWithContext(context.Background(), "", b.queue, true, false, amqp091.Publishing{
			Headers: h, ContentType: amqp.ContentTypeJSON, DeliveryMode: amqp091.Persistent, MessageId: id, Body: body})
	})
	if err != nil {
		t.Fatal(err)
	}
}

// CONTRACT: a consumer never trusts a retry copy's headers further than its
// own configuration. Copies on the work queue as if back from a wait
// queue: intents -7 (an AMQP int) and intents that is no number are attempt
// 2; intents 1000000 and the largest int64 are the last attempt, 3, and the
// failure there dead-letters them with intents 3 (the int64 once overflowed
// into ever-negative attempts, retried forever). A no_abans in the year
// 2100 does not delay a delivery: RabbitMQ waits only in wait queues whose
// TTL is the consumer's own backoff.
func TestForgedRetryHeadersAreClampedToTheConfiguration(t *testing.T) {
	b := setup(t)
	var mu sync.Mutex
	attempt := map[string]int{}
	failing := map[string]bool{}
	c, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		attempt[m.Envelope.ID] = m.Attempt
		fail := failing[m.Envelope.ID]
		mu.Unlock()
		if fail {
			return outcome.Transient(errors.New("mapes: 503"))
		}
		return recordEffect(ctx, tx, m, 0)
	}))
	neg, negBody := rawEvent(t, "prova.feta")
	word, wordBody := rawEvent(t, "prova.feta")
	many, manyBody := rawEvent(t, "prova.feta")
	top, topBody := rawEvent(t, "prova.feta")
	mu.Lock()
	failing[many], failing[top] = true, true
	mu.Unlock()
	publishRaw(t, b, neg, negBody, amqp091.Table{"intents": int32(-7), "no_abans": "4102444800.000000"})
	publishRaw(t, b, word, wordBody, amqp091.Table{"intents": "tres"})
	publishRaw(t, b, many, manyBody, amqp091.Table{"intents": "1000000"})
	publishRaw(t, b, top, topBody, amqp091.Table{"intents": int64(math.MaxInt64)})
	testkit.Eventually(t, 20*time.Second, "2 processed and 2 dead-lettered", func() bool {
		st := c.Stats()
		return st.Processed == 2 && st.DeadLettered == 2
	})

	if st := c.Stats(); st.Retried != 0 {
		t.Fatalf("stats %+v, want no retry", st)
	}
	mu.Lock()
	for id, want := range map[string]int{neg: 2, word: 2, many: 3, top: 3} {
		if attempt[id] != want {
			t.Errorf("message %s on attempt %d, want %d", id, attempt[id], want)
		}
	}
	mu.Unlock()
	dlq := newTestDLQ(t, b.conn, b.queue)
	testkit.Eventually(t, 10*time.Second, "2 letters in the DLQ", func() bool { n, _ := dlq.Count(context.Background()); return n == 2 })
	letters, err := dlq.List(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range letters {
		if l.Attempts != 3 || l.Reason != "transitori esgotat: mapes: 503" {
			t.Errorf("dead letter %s: intents %d, motiu %q; want 3 and the handler's error", l.EventID, l.Attempts, l.Reason)
		}
	}
}

// Every time header a RabbitMQ consumer writes is unix seconds as a decimal
// string (contract.FormatTime), as on Kafka: no_abans on the wait-queue
// copy, primera_fallada and mort_en on the dead letter. A copy still queued
// from before, with primera_fallada in integer milliseconds, keeps its time:
// the handler sees it, and the next copy carries it in seconds.
func TestTimeHeadersAreUnixSecondsAndOldMillisecondsStillRead(t *testing.T) {
	b := setup(t)
	const legacyMS = int64(1789000000123)
	var mu sync.Mutex
	var first []time.Time
	var notBefore []string
	c, _ := startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		nb, _ := m.Header("no_abans")
		mu.Lock()
		first, notBefore = append(first, m.FirstFailure), append(notBefore, nb)
		mu.Unlock()
		return outcome.Transient(errors.New("mapes: 503"))
	}))
	id, body := rawEvent(t, "prova.feta")
	start := time.Now()
	// As the consumer wrote it before: intents and primera_fallada as AMQP
	// longs, no_abans with three decimals.
	publishRaw(t, b, id, body, amqp091.Table{"intents": int64(1), "primera_fallada": legacyMS, "no_abans": "1789000000.123"})
	dlq := newTestDLQ(t, b.conn, b.queue)
	testkit.Eventually(t, 20*time.Second, "the dead letter", func() bool {
		n, _ := dlq.Count(context.Background())
		return n == 1 && c.Stats().DeadLettered == 1
	})

	if st := c.Stats(); st.Retried != 1 || st.DeadLettered != 1 {
		t.Fatalf("stats %+v, want 1 retried, 1 dead-lettered", st)
	}
	mu.Lock()
	want := time.UnixMilli(legacyMS)
	if len(first) != 2 || !first[0].Equal(want) || !first[1].Equal(want) {
		t.Fatalf("FirstFailure on attempts 2 and 3: %v, want %v twice", first, want)
	}
	// The wait-queue copy's no_abans: now + 200 ms, in seconds.
	nb := notBefore[1]
	mu.Unlock()
	if ts, err := contract.ParseTime(nb); err != nil || nb != contract.FormatTime(ts) || ts.Before(start) {
		t.Fatalf("no_abans of the wait-queue copy %q: want unix seconds with six decimals, after the test started", nb)
	}
	letters, err := dlq.List(context.Background(), nil)
	if err != nil || len(letters) != 1 {
		t.Fatalf("%d letters, %v", len(letters), err)
	}
	l := letters[0]
	if ff, _ := l.Headers["primera_fallada"].(string); ff != "1789000000.123000" {
		t.Fatalf("primera_fallada of the dead letter %#v, want \"1789000000.123000\"", l.Headers["primera_fallada"])
	}
	dead, _ := l.Headers["mort_en"].(string)
	if ts, err := contract.ParseTime(dead); err != nil || dead != contract.FormatTime(ts) || !l.DeadAt.Equal(ts) || ts.Before(start) {
		t.Fatalf("mort_en %#v (DeadAt %v): want unix seconds with six decimals, read back as DeadAt", l.Headers["mort_en"], l.DeadAt)
	}
}

// A delivery whose tipus header disagrees with its envelope is dead-lettered
// (natively: nack without requeue) as a permanent esquema failure and
// logged, never processed or dropped on a guess: a header that is not
// UTF-8, a handled header on an envelope of another tipus, a header that is
// not a string. As on Kafka, a well-formed header the consumer does not
// handle is filtered on before decoding (ignored), and without a header the
// envelope's tipus decides.
func TestTipusHeaderThatDisagreesWithTheEnvelopeIsDeadLettered(t *testing.T) {
	b := setup(t)
	logBuf := &testlog.Buffer{}
	cfg := b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return recordEffect(ctx, tx, m, 0)
	})
	cfg.Types = []string{"prova.feta"}
	cfg.Logger = slog.New(slog.NewTextHandler(logBuf, nil))
	c, _ := startConsumer(t, cfg)
	notUTF8, notUTF8Body := rawEvent(t, "prova.feta")
	other, otherBody := rawEvent(t, "prova.altra")
	number, numberBody := rawEvent(t, "prova.feta")
	skipped, skippedBody := rawEvent(t, "prova.feta")
	bare, bareBody := rawEvent(t, "prova.altra")
	good, goodBody := rawEvent(t, "prova.feta")
	publishRaw(t, b, notUTF8, notUTF8Body, amqp091.Table{"tipus": []byte("prova.feta\xff")})
	publishRaw(t, b, other, otherBody, amqp091.Table{"tipus": "prova.feta"})
	publishRaw(t, b, number, numberBody, amqp091.Table{"tipus": int32(5)})
	publishRaw(t, b, skipped, skippedBody, amqp091.Table{"tipus": "prova.altra"})
	publishRaw(t, b, bare, bareBody, amqp091.Table{})
	publishRaw(t, b, good, goodBody, amqp091.Table{"tipus": "prova.feta"})
	testkit.Eventually(t, 20*time.Second, "the 6 deliveries settled", func() bool {
		st := c.Stats()
		return st.Processed+st.Ignored+st.DeadLettered == 6
	})

	if st := c.Stats(); st.Processed != 1 || st.Ignored != 2 || st.DeadLettered != 3 || st.Retried != 0 {
		t.Fatalf("stats %+v, want 1 processed, 2 ignored, 3 dead-lettered\n%s", st, logBuf.String())
	}
	if rows, _ := countEffects(t, b.db); rows != 1 {
		t.Fatalf("%d effects, want 1", rows)
	}
	dlq := newTestDLQ(t, b.conn, b.queue)
	testkit.Eventually(t, 10*time.Second, "3 letters in the DLQ", func() bool { n, _ := dlq.Count(context.Background()); return n == 3 })
	want := map[string]string{
		notUTF8: `permanent: esquema: header tipus not UTF-8 \"prova.feta\\xff\" does not match the envelope's \"prova.feta\"`,
		other:   `permanent: esquema: header tipus \"prova.feta\" does not match the envelope's \"prova.altra\"`,
		number:  `permanent: esquema: header tipus not text \"5 (int32)\" does not match the envelope's \"prova.feta\"`,
	}
	for id, motiu := range want {
		if !logged(logBuf, `msg="consumer: dead letter"`, "id="+id, `motiu="`+motiu+`"`) {
			t.Errorf("no dead-letter log line for %s with motiu %s:\n%s", id, motiu, logBuf.String())
		}
		if _, err := dlq.Show(context.Background(), id); err != nil {
			t.Errorf("%s: %v", id, err)
		}
	}
}

// logged reports whether one line of buf contains every part.
func logged(buf *testlog.Buffer, parts ...string) bool {
	for _, line := range strings.Split(buf.String(), "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return true
		}
	}
	return false
}
