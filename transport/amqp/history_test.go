package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
)

// A message that fails on every attempt reaches the DLQ with its attempt
// history (historial_intents): one entry per attempt, each with its error,
// at increasing times. A forged copy whose time headers and history do not
// parse gets this failure's primera_fallada and a history of its own
// attempts only (contract.CopyHeaders, the builder both sources call).
func TestDeadLetterCarriesTheAttemptHistory(t *testing.T) {
	b := setup(t)
	startConsumer(t, b.consumerConfig(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return outcome.Transient(fmt.Errorf("mapes: 503 a l'intent %d", m.Attempt))
	}))
	start := time.Now()
	fresh, freshBody := rawEvent(t, "prova.feta")
	forged, forgedBody := rawEvent(t, "prova.feta")
	publishRaw(t, b, fresh, freshBody, amqp091.Table{})
	publishRaw(t, b, forged, forgedBody, amqp091.Table{"intents": "1", "primera_fallada": "NaN",
		"data_original": "ahir", "historial_intents": "{no és json"})
	dlq := newTestDLQ(t, b.conn, b.queue)
	testkit.Eventually(t, 30*time.Second, "2 letters in the DLQ", func() bool { n, _ := dlq.Count(context.Background()); return n == 2 })
	letters, err := dlq.List(context.Background(), nil)
	if err != nil || len(letters) != 2 {
		t.Fatalf("%d letters, %v", len(letters), err)
	}
	for _, l := range letters {
		raw, _ := l.Headers[contract.HeaderHistory].(string)
		h := contract.ParseHistory(raw)
		first := 1
		if l.EventID == forged {
			first = 2
			ff, _ := l.Headers[contract.HeaderFirstFailure].(string)
			if ts, err := contract.ParseTime(ff); err != nil || ts.Before(start) {
				t.Errorf("forged copy's letter: primera_fallada %q, want this failure's time", ff)
			}
			if v, ok := l.Headers[contract.HeaderOriginalTime]; ok {
				t.Errorf("forged copy's letter: data_original %v, want none (unparsable, no timestamp)", v)
			}
		}
		if err := checkHistory(h, first, 3, start); err != nil {
			t.Errorf("letter %s: %v (%s)", l.EventID, err, raw)
		}
	}
}

// checkHistory says what is wrong with h, which should list attempts first
// to last, each with its error, at increasing times after start.
func checkHistory(h []contract.FailedAttempt, first, last int, start time.Time) error {
	if len(h) != last-first+1 {
		return fmt.Errorf("%d attempts in the history, want %d", len(h), last-first+1)
	}
	prev := start
	for i, a := range h {
		want := fmt.Sprintf("mapes: 503 a l'intent %d", first+i)
		if a.N != first+i || a.Error != want || a.At.Before(prev) {
			return fmt.Errorf("attempt %d: %+v, want N %d, error %q, after %v", i, a, first+i, want, prev)
		}
		prev = a.At
	}
	if !h[len(h)-1].At.After(h[0].At) {
		return errors.New("the attempts' times do not increase")
	}
	return nil
}
