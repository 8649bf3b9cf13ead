package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
)

// CONTRACT: a consumer never trusts a retry copy's headers further than its
// own configuration. Forged copies on one retry partition (one key): one
// due in the year 2100, one whose no_abans is a number too large to be a
// time, one with intents -7, one with intents past every attempt, one with
// an intents that overflows. Each is handled as the configuration allows:
// the two far ones after BackoffMax (1 s), not in 2100 and not at once;
// intents -7 as attempt 2; the huge ones as the last attempt, whose failure
// is a dead letter carrying intents 3. Nothing stays held, and the retry
// partition's committed offset passes every copy.
func TestForgedRetryHeadersAreClampedToTheConfiguration(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const maxWait = time.Second
	forged := func(n int, headers ...string) (event, *kgo.Record) {
		e := seqEvent("F", n)
		rec := e.record()
		rec.Topic = topic + contract.RetrySuffix
		for i := 0; i < len(headers); i += 2 {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: headers[i], Value: []byte(headers[i+1])})
		}
		return e, rec
	}
	// primera_fallada, read by one parser: the milliseconds RabbitMQ wrote
	// before, a short decimal, something that is no time.
	y2100, r0 := forged(0, "intents", "1", "no_abans", "4102444800.000000", "primera_fallada", "1789000000123")
	huge, r1 := forged(1, "intents", "1", "no_abans", "1e300")
	neg, r2 := forged(2, "intents", "-7", "no_abans", "NaN")
	many, r3 := forged(3, "intents", "1000000", "primera_fallada", "1789000000.5")
	overflow, r4 := forged(4, "intents", "9223372036854775807", "primera_fallada", "NaN")
	var mu sync.Mutex
	attempt := map[string]int{}
	at := map[string]time.Time{}
	first := map[string]time.Time{}
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		attempt[m.Envelope.ID], at[m.Envelope.ID], first[m.Envelope.ID] = m.Attempt, time.Now(), m.FirstFailure
		mu.Unlock()
		if m.Envelope.ID == many.id || m.Envelope.ID == overflow.id {
			return outcome.Transient(errors.New("mapes: 503"))
		}
		return effect(ctx, tx, m)
	})
	cfg.BackoffMax = maxWait
	r := b.run(cfg)
	// Once a first event is processed the member holds its partitions, so
	// a copy due at once is handled well within maxWait of its publication.
	b.publishEvents(seqEvent("warm", 0))
	testkit.Eventually(t, time.Minute, "the first event processed", func() bool { return r.c.Stats().Processed == 1 })
	published := time.Now()
	b.publish(r0, r1, r2, r3, r4)
	testkit.Eventually(t, time.Minute, "3 copies processed and 2 dead-lettered", func() bool {
		st := r.c.Stats()
		return st.Processed == 4 && st.DeadLettered == 2
	})

	testkit.Eventually(t, time.Minute, "the retry partition committed past every copy", func() bool { return b.committed(topic+contract.RetrySuffix) == 5 })
	held := b.gauge(consumer.MetricHeld)
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if st := r.c.Stats(); st.Retried != 0 || held != 0 {
		t.Fatalf("stats %+v, %v held; want no new retry and nothing held", st, held)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, e := range []event{y2100, huge} {
		// The copy was fetched after it was published and held from then
		// for maxWait at least.
		if d := at[e.id].Sub(published); d < maxWait {
			t.Errorf("copy %d handled %v after it was published, want at least BackoffMax %v", e.dades.(comanda).N, d, maxWait)
		}
	}
	want := map[string]int{y2100.id: 2, huge.id: 2, neg.id: 2, many.id: 3, overflow.id: 3}
	for id, w := range want {
		if attempt[id] != w {
			t.Errorf("event %s on attempt %d, want %d", id, attempt[id], w)
		}
	}
	if want := time.UnixMilli(1789000000123); !first[y2100.id].Equal(want) || !first[many.id].Equal(time.Unix(1789000000, 5e8)) ||
		!first[overflow.id].IsZero() {
		t.Errorf("FirstFailure %v, %v, %v; want %v, 1789000000.5 and none", first[y2100.id], first[many.id], first[overflow.id], want)
	}
	dead := b.read(topic+contract.DLQSuffix, 2)
	if len(dead) != 2 {
		t.Fatalf("%d dead letters, want 2", len(dead))
	}
	for _, d := range dead {
		id := hdr(d, "id_esdeveniment")
		if hdr(d, "intents") != "3" || hdr(d, "motiu") != "transitori esgotat: mapes: 503" {
			t.Errorf("dead letter %s: intents %q, motiu %q; want 3 and the handler's error", id, hdr(d, "intents"), hdr(d, "motiu"))
		}
		// The copy carries primera_fallada in the one encoding: the
		// forged copy's own when it is a time, else the failure's.
		ff := hdr(d, "primera_fallada")
		if ts, err := contract.ParseTime(ff); err != nil || ff != contract.FormatTime(ts) ||
			(id == many.id && ff != "1789000000.500000") || (id == overflow.id && ts.Before(published)) {
			t.Errorf("dead letter %s: primera_fallada %q", id, ff)
		}
	}
}

// A record whose tipus header disagrees with its envelope is dead-lettered
// as a permanent esquema failure, logged, never dropped in silence: two
// tipus headers (the first one not handled), a header that is not UTF-8, a
// handled header on an envelope of another tipus. A single well-formed
// header the consumer does not handle is filtered on before decoding
// (ignored, counted), and a record whose header agrees is processed.
func TestTipusHeaderThatDisagreesWithTheEnvelopeIsDeadLettered(t *testing.T) {
	t.Parallel()
	b := setup(t)
	withTypes := func(e event, types ...string) *kgo.Record {
		rec := e.record()
		var hs []kgo.RecordHeader
		for _, h := range rec.Headers {
			if h.Key != "tipus" {
				hs = append(hs, h)
			}
		}
		for _, ty := range types {
			hs = append(hs, kgo.RecordHeader{Key: "tipus", Value: []byte(ty)})
		}
		rec.Headers = hs
		return rec
	}
	two, notUTF8, other := seqEvent("T", 0), seqEvent("T", 1), seqEvent("T", 2)
	other.tipus = "comanda.pagada"
	ignored, good := seqEvent("T", 3), seqEvent("T", 4)
	b.publish(
		withTypes(two, "comanda.pagada", "comanda.creada"),
		withTypes(notUTF8, "comanda.creada\xff"),
		withTypes(other, "comanda.creada"),
		withTypes(ignored, "comanda.pagada"),
		withTypes(good, "comanda.creada"),
	)
	st := b.runUntil(b.config(effect), "the 5 records finished", func(st consumer.Stats) bool {
		return st.DeadLettered+st.Ignored+st.Processed == 5 && b.committed(topic) == 5
	})
	if st.DeadLettered != 3 || st.Ignored != 1 || st.Processed != 1 || st.Retried != 0 || b.effects() != 1 {
		t.Fatalf("stats %+v, %d effects; want 3 dead-lettered, 1 ignored, 1 processed, 1 effect", st, b.effects())
	}
	want := map[string]string{
		two.id:     `permanent: esquema: header tipus ambiguous: "comanda.pagada" and "comanda.creada" does not match the envelope's "comanda.creada"`,
		notUTF8.id: `permanent: esquema: header tipus not UTF-8 "comanda.creada\xff" does not match the envelope's "comanda.creada"`,
		other.id:   `permanent: esquema: header tipus "comanda.creada" does not match the envelope's "comanda.pagada"`,
	}
	dead := b.read(topic+contract.DLQSuffix, 3)
	if len(dead) != 3 {
		t.Fatalf("%d dead letters, want 3", len(dead))
	}
	for _, d := range dead {
		id := hdr(d, "id_esdeveniment")
		if got := hdr(d, "motiu"); got != want[id] || hdr(d, "intents") != "1" {
			t.Errorf("dead letter %s: motiu %q intents %q\nwant motiu %q at attempt 1", id, got, hdr(d, "intents"), want[id])
		}
		if !b.logged(`level=ERROR msg="consumer: dead letter"`, "id="+id, "esquema: header tipus") {
			t.Errorf("no error log line for %s:\n%s", id, b.logBuf.String())
		}
	}
	if got := b.dlqTotalOf("permanent: esquema"); got != 3 {
		t.Fatalf("km0_dlq_total{motiu=\"permanent: esquema\"} = %v, want 3", got)
	}
	if strings.Contains(b.logBuf.String(), ignored.id) {
		t.Fatalf("the ignored record was logged as a failure:\n%s", b.logBuf.String())
	}
}
