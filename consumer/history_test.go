package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
)

// On Kafka as on RabbitMQ (transport/amqp TestDeadLetterCarriesTheAttemptHistory),
// a message that fails on every attempt reaches <topic>.dlq with its attempt
// history: one entry per attempt, each with its error, at increasing times.
// A forged retry copy whose time headers and history do not parse gets this
// failure's primera_fallada, the retry record's time as data_original, and
// a history of its own attempts only.
func TestDeadLetterCarriesTheAttemptHistory(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := b.run(b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return outcome.Transient(fmt.Errorf("mapes: 503 a l'intent %d", m.Attempt))
	}))
	start := time.Now()
	fresh, forged := seqEvent("H", 0), seqEvent("H", 1)
	rec := forged.record()
	rec.Topic = contract.RetryTopic(topic)
	rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: "intents", Value: []byte("1")},
		kgo.RecordHeader{Key: "primera_fallada", Value: []byte("NaN")},
		kgo.RecordHeader{Key: "data_original", Value: []byte("ahir")},
		kgo.RecordHeader{Key: "historial_intents", Value: []byte("{no és json")})
	b.publishEvents(fresh)
	b.publish(rec)
	testkit.Eventually(t, time.Minute, "2 dead letters", func() bool { return r.c.Stats().DeadLettered == 2 })
	dead := b.read(contract.DLQName(topic), 2)
	if len(dead) != 2 {
		t.Fatalf("%d dead letters, want 2", len(dead))
	}
	for _, d := range dead {
		raw := hdr(d, contract.HeaderHistory)
		first := 1
		if hdr(d, "id_esdeveniment") == forged.id {
			first = 2
			for _, k := range []string{contract.HeaderFirstFailure, contract.HeaderOriginalTime} {
				if ts, err := contract.ParseTime(hdr(d, k)); err != nil || ts.Before(start.Add(-time.Second)) {
					t.Errorf("forged copy's letter: %s %q, want a time of this run", k, hdr(d, k))
				}
			}
		}
		h := contract.ParseHistory(raw)
		if len(h) != 4-first {
			t.Errorf("letter %s: %d attempts in the history %s, want %d", hdr(d, "id_esdeveniment"), len(h), raw, 4-first)
			continue
		}
		prev := start
		for i, a := range h {
			want := fmt.Sprintf("mapes: 503 a l'intent %d", first+i)
			if a.N != first+i || a.Error != want || a.At.Before(prev) {
				t.Errorf("letter %s, attempt %d: %+v, want N %d, error %q, after %v", hdr(d, "id_esdeveniment"), i, a, first+i, want, prev)
			}
			prev = a.At
		}
		if !h[len(h)-1].At.After(h[0].At) {
			t.Errorf("letter %s: the attempts' times do not increase: %s", hdr(d, "id_esdeveniment"), raw)
		}
	}
}
