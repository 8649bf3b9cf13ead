package main

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/amqp"
)

// `km0 dlq ls --queue` used to fail outright behind one forged letter (an
// intents of 2^31, a motiu of 8,000 bytes); the index now takes it clamped
// and cut, sets aside one it refuses (here by a CHECK the test adds), and
// ls lists the good letters and says how many were set aside.
func TestDLQLsOnRabbitMQSurvivesForgedLetters(t *testing.T) {
	t.Parallel()
	r := newRabbitDLQ(t)
	ctx := context.Background()
	if _, err := r.db.Pool.Exec(ctx, `ALTER TABLE cartes_mortes ADD CONSTRAINT prova_verinos
		CHECK (tipus IS DISTINCT FROM 'verinos')`); err != nil {
		t.Fatal(err)
	}
	rnd := rand.New(rand.NewPCG(3, 8000)) // letters that do not compress below the btree limit
	noise := make([]byte, 8000)
	for i := range noise {
		noise[i] = byte('a' + rnd.IntN(26))
	}
	err := r.conn.Do(ctx, func(ch *amqp091.Channel) error {
		for _, h := range []amqp091.Table{
			{"intents": int64(2147483648), "motiu": "permanent: esquema: " + string(noise)},
			{"tipus": "verinos", "motiu": "permanent: esquema: x"},
			{"intents": "2", "motiu": "permanent: esquema: bo"},
		} {
			h[amqp.HeaderOriginQueue] = r.queue
			if err := ch.PublishWithContext(ctx, "", contract.DLQName(r.queue), false, false,
				amqp091.Publishing{Body: []byte(`{}`), Headers: h, Timestamp: time.Now()}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "3 letters on the DLQ", func() bool { return r.onBroker() == 3 })
	out, err := r.run("ls")
	if err != nil || !strings.Contains(out, "2 new dead letter(s) indexed") || !strings.Contains(out, "2 dead letter(s)") ||
		!strings.Contains(out, "1 letter(s) refused by the index, set aside in table cartes_refusades") ||
		!strings.Contains(out, "2147483647") {
		t.Fatalf("ls: %v\n%s", err, out)
	}
	if b, i := r.onBroker(), r.indexed(); b != 0 || i != 2 {
		t.Fatalf("%d left on the broker, %d indexed; want 0 and 2", b, i)
	}
	if out, err := r.run("ls", "--json"); err != nil || !strings.Contains(out, `"refusades": 1`) {
		t.Fatalf("ls --json does not count the refused letter: %v\n%s", err, out)
	}
}
