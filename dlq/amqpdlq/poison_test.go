package amqpdlq

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/amqp"
)

// noiseText returns n lowercase letters that do not compress (a btree index
// compresses a repetitive value below its row limit).
func noiseText(n int) string {
	r := rand.New(rand.NewPCG(2, uint64(n)))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + r.IntN(26))
	}
	return string(b)
}

// The RabbitMQ side of one forged letter never hiding the others: forged
// letters put straight on the DLQ (intents of 2^31 and -5, a motiu of 8,000
// bytes, a cua_origen of 4,000, invalid UTF-8, a NUL, and one the index
// refuses), then a good letter. One Sync takes them all: 7 indexed (clamped
// and cut, full text in the headers), 1 set aside with its bytes (the broker
// no longer has it), counted and logged once, the queue drained; the good
// letter alerted; List (what `km0 dlq ls --queue` shows) counts the refusal;
// the next letter is numbered after the refused one.
func TestForgedLettersNeverStopTheRabbitMQIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r := setupRabbit(t)
	if _, err := r.pool.Pool.Exec(ctx, `ALTER TABLE cartes_mortes ADD CONSTRAINT prova_verinos
		CHECK (tipus IS DISTINCT FROM 'verinos')`); err != nil {
		t.Fatal(err)
	}
	conn, err := amqp091.Dial(amqptest.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().Truncate(time.Second)
	forged := []amqp091.Table{
		{"intents": int64(2147483648)},
		{"intents": int32(-5)},
		{"motiu": "permanent: esquema: " + noiseText(8000)},
		{amqp.HeaderOriginQueue: noiseText(4000)},
		{"motiu": "permanent: esquema: \xff\xfe", "grup_consumidor": "g\xc3"},
		{"motiu": "permanent: esquema: a\x00b", "tipus": "comanda\x00creada"},
		{"tipus": "verinos"},
	}
	for i, h := range forged {
		base := amqp091.Table{"intents": "3", "motiu": "permanent: esquema: x", amqp.HeaderOriginQueue: r.queue,
			"tipus": "comanda.creada", contract.HeaderDeadAt: contract.FormatTime(now.Add(time.Duration(i) * time.Second))}
		for k, v := range h {
			base[k] = v
		}
		if err := ch.PublishWithContext(ctx, "", contract.DLQName(r.queue), false, false,
			amqp091.Publishing{Body: []byte(`{"n":` + string(rune('0'+i)) + `}`), Headers: base}); err != nil {
			t.Fatal(err)
		}
	}
	// The forged letters went unconfirmed on this connection, the good one
	// comes through another: it is numbered after them only once they are in.
	testkit.Eventually(t, 10*time.Second, "7 forged letters on the DLQ", func() bool { return r.onBroker(t) == 7 })
	r.exhausted(t, "00000000-0000-4000-8000-000000000001", now)
	testkit.Eventually(t, 10*time.Second, "8 letters on the DLQ", func() bool { return r.onBroker(t) == 8 })

	reg := prometheus.NewRegistry()
	al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: r.store, Backend: r.backend(t, 0), Alerter: al})
	if err != nil {
		t.Fatal(err)
	}
	res, err := svc.Sync(ctx)
	if err != nil || res.Read != 8 || len(res.New) != 7 || len(res.Refused) != 1 {
		t.Fatalf("sync: read %d, new %d, refused %d, %v; want 8, 7, 1 and no error", res.Read, len(res.New), len(res.Refused), err)
	}
	if n := r.onBroker(t); n != 0 {
		t.Fatalf("%d letters left on the broker, want 0", n)
	}
	byNumber := map[int64]*dlq.Letter{}
	for _, l := range r.indexed(t) {
		byNumber[l.Offset] = l
	}
	if len(byNumber) != 7 || byNumber[6] != nil {
		t.Fatalf("index holds %d letters (refused one present: %v), want 7 without number 6", len(byNumber), byNumber[6] != nil)
	}
	if a, b := byNumber[0].Attempts, byNumber[1].Attempts; a != math.MaxInt32 || b != 0 {
		t.Fatalf("intents 2^31 indexed as %d, -5 as %d; want %d and 0", a, b, math.MaxInt32)
	}
	if l := byNumber[2]; len(l.Reason) != dlq.MaxIndexedText || l.Class() != "permanent: esquema" || !hasHeader(l, "motiu", l.Reason) {
		t.Fatalf("motiu of 8000: %d bytes indexed, class %q", len(l.Reason), l.Class())
	}
	if v := headerValue(byNumber[2], "motiu"); len(v) != len("permanent: esquema: ")+8000 {
		t.Fatalf("motiu of 8000: the stored header holds %d bytes", len(v))
	}
	if l := byNumber[3]; len(l.OriginalTopic) != dlq.MaxIndexedText || len(headerValue(l, amqp.HeaderOriginQueue)) != 4000 {
		t.Fatalf("cua_origen of 4000: %d bytes indexed, header %d", len(l.OriginalTopic), len(headerValue(l, amqp.HeaderOriginQueue)))
	}
	if l := byNumber[4]; l.Reason != "permanent: esquema: \uFFFD" || l.ConsumerGroup != "g\uFFFD" {
		t.Fatalf("invalid UTF-8: motiu %q, group %q", l.Reason, l.ConsumerGroup)
	}
	if l := byNumber[5]; l.Reason != "permanent: esquema: a\uFFFDb" || l.Type != "comanda\uFFFDcreada" {
		t.Fatalf("NUL: motiu %q, tipus %q", l.Reason, l.Type)
	}
	if l := byNumber[7]; l.EventID != "00000000-0000-4000-8000-000000000001" || l.Attempts != 3 {
		t.Fatalf("good letter: %+v", l)
	}
	refused, err := r.store.Refused(ctx, dlq.Filter{Topic: r.queue})
	if err != nil || len(refused) != 1 || refused[0].ID != dlq.KafkaID(contract.DLQName(r.queue), 0, 6) || refused[0].Code != "23514" {
		t.Fatalf("refused: %+v, %v; want letter 6, 23514", refused, err)
	}
	var body []byte
	if err := r.pool.Pool.QueryRow(ctx, "SELECT valor FROM cartes_refusades").Scan(&body); err != nil || string(body) != `{"n":6}` {
		t.Fatalf("the refused letter's bytes: %q, %v", body, err)
	}
	if n := counterSum(t, reg, "km0_dlq_letters_total"); n != 7 {
		t.Fatalf("km0_dlq_letters_total = %v, want 7", n)
	}
	if n := counterSum(t, reg, "km0_dlq_refused_total"); n != 1 {
		t.Fatalf("km0_dlq_refused_total = %v, want 1", n)
	}
	ls, err := svc.List(ctx, dlq.Filter{})
	if err != nil || len(ls.Letters) != 7 || ls.Refused != 1 {
		t.Fatalf("list: %v; want 7 letters and 1 refused", err)
	}
	// The next letter is numbered after the refused one, never given its ID.
	r.exhausted(t, "00000000-0000-4000-8000-000000000002", now)
	testkit.Eventually(t, 10*time.Second, "1 letter on the DLQ", func() bool { return r.onBroker(t) == 1 })
	res, err = svc.Sync(ctx)
	if err != nil || len(res.New) != 1 || res.New[0].Offset != 8 || len(res.Refused) != 0 {
		t.Fatalf("second sync: %+v, %v; want one new letter numbered 8", res, err)
	}
}

// headerValue returns the stored header k of l, or "".
func headerValue(l *dlq.Letter, k string) string {
	for _, h := range l.Headers {
		if h.Key == k {
			return h.Value
		}
	}
	return ""
}

// counterSum adds up every series of the counter name in reg.
func counterSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}
