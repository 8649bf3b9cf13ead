package amqpdlq

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// rabbit is a RabbitMQ work queue with its DLQ and a migrated index.
type rabbit struct {
	conn  *amqp.Conn
	store *dlq.Store
	pool  *pgtest.Schema
	queue string
	dlx   *amqp.Publisher // publishes to km0.dlx: routing key = queue lands in <queue>.dlq
}

func setupRabbit(t *testing.T) *rabbit {
	t.Helper()
	ctx := context.Background()
	conn := amqptest.Dial(t)
	s := pgtest.NewSchema(t)
	if _, err := migrate.Up(ctx, s.Pool, s.Names(), dlq.Migrations); err != nil {
		t.Fatal(err)
	}
	q := amqptest.Name("t.dlqidx")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{q, contract.DLQName(q)} })
	if err := conn.Declare(ctx, amqp.WorkQueueTopology("", q, q, false)); err != nil {
		t.Fatal(err)
	}
	dlx, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: amqp.DLXDefault, ExchangeKind: amqp091.ExchangeDirect})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dlx.Close() })
	return &rabbit{conn: conn, store: dlq.NewStore(s.Pool, s.Name), pool: s, queue: q, dlx: dlx}
}

func (r *rabbit) backend(t *testing.T, batch int) *Backend {
	t.Helper()
	b, err := New(Config{Conn: r.conn, Queues: []string{r.queue}, Batch: batch})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

// exhausted puts in the DLQ what the consumer publishes when the transient
// attempts run out.
func (r *rabbit) exhausted(t *testing.T, id string, deadAt time.Time) {
	t.Helper()
	m := &transport.Message{Topic: r.queue, Key: []byte("P-1"), Value: amqpEvent(t, id, deadAt), Headers: []transport.Header{
		{Key: contract.HeaderEventID, Value: id}, {Key: contract.HeaderType, Value: "comanda.creada"},
		{Key: contract.HeaderAttempts, Value: "3"}, {Key: contract.HeaderReason, Value: "transitori esgotat: mapes: 503"},
		{Key: amqp.HeaderOriginQueue, Value: r.queue}, {Key: contract.HeaderDeadAt, Value: contract.FormatTime(deadAt)},
		{Key: contract.HeaderFirstFailure, Value: contract.FormatTime(deadAt.Add(-7 * time.Second))}}}
	if err := r.dlx.Publish(context.Background(), []*transport.Message{m}); err != nil {
		t.Fatal(err)
	}
}

// native publishes an event to the work queue and rejects it without
// requeue, as the consumer does for a permanent failure: RabbitMQ moves it
// to the DLQ with x-death.
func (r *rabbit) native(t *testing.T, id string) {
	t.Helper()
	ctx := context.Background()
	m := &transport.Message{Topic: r.queue, Key: []byte("P-2"), Value: amqpEvent(t, id, time.Now()),
		Headers: []transport.Header{{Key: contract.HeaderEventID, Value: id}, {Key: contract.HeaderType, Value: "comanda.creada"}}}
	pub, err := amqp.NewPublisher(ctx, r.conn, amqp.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close() //nolint:errcheck
	if err := pub.Publish(ctx, []*transport.Message{m}); err != nil {
		t.Fatal(err)
	}
	err = r.conn.Do(ctx, func(ch *amqp091.Channel) error {
		d, ok, err := ch.Get(r.queue, false)
		if err != nil || !ok {
			return fmt.Errorf("get from the work queue: ok=%v, %w", ok, err)
		}
		return d.Nack(false, false)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// amqpEvent returns a valid envelope for id at t.
func amqpEvent(t *testing.T, id string, at time.Time) []byte {
	t.Helper()
	e := &envelope.Envelope{ID: id, Type: "comanda.creada", Version: 1, TimeMS: at.UnixMilli(), Origin: "comandes",
		Data: []byte(`{"id":"P-1"}`)}
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func (r *rabbit) onBroker(t *testing.T) int {
	t.Helper()
	return amqptest.DLQLen(t, r.conn, r.queue)
}

func (r *rabbit) indexed(t *testing.T) []*dlq.Letter {
	t.Helper()
	ls, err := r.store.List(context.Background(), dlq.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	return ls
}

// The invariant: a RabbitMQ dead letter is acked off the broker only after
// the index transaction that holds it committed. Crash point A: the index
// transaction fails (its table is missing) → nothing is acked. Crash point
// B: Sync dies after the commit and before the ack → the letters are in the
// index and, requeued, still on the broker; the next Sync recognises the
// redeliveries, indexes nothing twice and acks them. A third Sync finds
// nothing. Every event id is in the index exactly once at the end.
func TestAMQPSyncAcksOnlyAfterCommit(t *testing.T) {
	t.Parallel()
	r := setupRabbit(t)
	ctx := context.Background()
	deadAt := time.Now().Add(-time.Minute).Truncate(time.Millisecond)
	r.exhausted(t, "e-transitori", deadAt)
	r.native(t, "e-permanent")
	testkit.Eventually(t, 10*time.Second, "2 letters in the DLQ", func() bool { return r.onBroker(t) == 2 })
	b := r.backend(t, 0)

	// Crash point A: the index transaction fails.
	broken := dlq.NewStore(r.pool.Pool, "no_such_schema")
	if _, err := b.Sync(ctx, broken); err == nil {
		t.Fatal("sync into a missing index table succeeded")
	}
	testkit.Eventually(t, 10*time.Second, "both letters back on the broker", func() bool { return r.onBroker(t) == 2 })
	if n := len(r.indexed(t)); n != 0 {
		t.Fatalf("%d letters indexed by a failed transaction", n)
	}

	// Crash point B: committed in the index, the ack never sent.
	crash := errors.New("crash between the index commit and the ack")
	b.afterCommit = func() error { return crash }
	res, err := b.Sync(ctx, r.store)
	if !errors.Is(err, crash) || len(res.New) != 2 {
		t.Fatalf("sync with a crash after the commit: %d new, %v", len(res.New), err)
	}
	testkit.Eventually(t, 10*time.Second, "both letters requeued", func() bool { return r.onBroker(t) == 2 })
	if n := len(r.indexed(t)); n != 2 {
		t.Fatalf("%d letters indexed after the commit, want 2", n)
	}

	b.afterCommit = nil
	res, err = b.Sync(ctx, r.store)
	if err != nil || res.Read != 2 || len(res.New) != 0 {
		t.Fatalf("sync of the redeliveries: read %d, new %d, %v; want 2 read, 0 new", res.Read, len(res.New), err)
	}
	if n := r.onBroker(t); n != 0 {
		t.Fatalf("%d letters left on the broker after a good sync", n)
	}
	res, err = b.Sync(ctx, r.store)
	if err != nil || res.Read != 0 || len(res.New) != 0 {
		t.Fatalf("second good sync: read %d, new %d, %v; want nothing", res.Read, len(res.New), err)
	}

	ls := r.indexed(t)
	byEvent := map[string]*dlq.Letter{}
	for _, l := range ls {
		byEvent[l.EventID] = l
	}
	if len(ls) != 2 || len(byEvent) != 2 {
		t.Fatalf("index holds %d letters for %d events, want 2 and 2", len(ls), len(byEvent))
	}
	tr, pe := byEvent["e-transitori"], byEvent["e-permanent"]
	if tr == nil || pe == nil {
		t.Fatalf("index lacks an event: %v", byEvent)
	}
	if tr.Reason != "transitori esgotat: mapes: 503" || tr.Attempts != 3 || tr.OriginalTopic != r.queue ||
		!tr.DeadAt.Equal(deadAt) || !tr.FirstFailure.Equal(deadAt.Add(-7*time.Second)) || string(tr.Key) != "P-1" {
		t.Fatalf("exhausted letter: %+v", tr)
	}
	if pe.Reason != "permanent: rejected by "+r.queue || pe.Attempts != 1 || pe.OriginalTopic != r.queue ||
		pe.Class() != "permanent" /* the queue name is no bounded class */ || !hasHeader(pe, "x-death", "rejected in "+r.queue) {
		t.Fatalf("native letter: %+v", pe)
	}
	ids := []string{ls[0].ID, ls[1].ID}
	slices.Sort(ids)
	if want := []string{dlq.KafkaID(contract.DLQName(r.queue), 0, 0), dlq.KafkaID(contract.DLQName(r.queue), 0, 1)}; !slices.Equal(ids, want) {
		t.Fatalf("ids %v, want %v", ids, want)
	}
}

func hasHeader(l *dlq.Letter, key, prefix string) bool {
	for _, h := range l.Headers {
		if h.Key == key && strings.HasPrefix(h.Value, prefix) {
			return true
		}
	}
	return false
}

// The index reads a RabbitMQ letter's times in the one encoding of the
// contract (unix seconds, a decimal string) and, so that an upgrade loses
// nothing, in the one the consumer wrote before: integer milliseconds as
// AMQP longs. Both letters index with their own dead time and first
// failure, to the microsecond and to the millisecond.
func TestAMQPLettersReadSecondsAndLegacyMilliseconds(t *testing.T) {
	t.Parallel()
	r := setupRabbit(t)
	ctx := context.Background()
	deadAt := time.Now().Add(-time.Minute).Truncate(time.Microsecond)
	first := deadAt.Add(-7 * time.Second)
	legacyDead, legacyFirst := deadAt.Truncate(time.Millisecond), first.Truncate(time.Millisecond)
	for id, times := range map[string][2]any{
		"e-segons": {contract.FormatTime(deadAt), contract.FormatTime(first)},
		"e-ms":     {legacyDead.UnixMilli(), legacyFirst.UnixMilli()},
	} {
		h := amqp091.Table{contract.HeaderEventID: id, contract.HeaderType: "comanda.creada", contract.HeaderAttempts: int64(3),
			contract.HeaderReason: "transitori esgotat: mapes: 503", amqp.HeaderOriginQueue: r.queue,
			contract.HeaderDeadAt: times[0], contract.HeaderFirstFailure: times[1]}
		if err := r.conn.Do(ctx, func(ch *amqp091.Channel) error {
			return ch.PublishWithContext(ctx, amqp.DLXDefault, r.queue, true, false,
				amqp091.Publishing{Headers: h, MessageId: id, DeliveryMode: amqp091.Persistent, Body: amqpEvent(t, id, deadAt)})
		}); err != nil {
			t.Fatal(err)
		}
	}
	testkit.Eventually(t, 10*time.Second, "2 letters in the DLQ", func() bool { return r.onBroker(t) == 2 })
	if _, err := r.backend(t, 0).Sync(ctx, r.store); err != nil {
		t.Fatal(err)
	}
	byEvent := map[string]*dlq.Letter{}
	for _, l := range r.indexed(t) {
		byEvent[l.EventID] = l
	}
	for id, want := range map[string][2]time.Time{"e-segons": {deadAt, first}, "e-ms": {legacyDead, legacyFirst}} {
		l := byEvent[id]
		if l == nil || !l.DeadAt.Equal(want[0]) || !l.FirstFailure.Equal(want[1]) || l.Attempts != 3 {
			t.Errorf("letter %s: %+v; want dead at %v, first failure %v, 3 attempts", id, l, want[0], want[1])
		}
	}
}

// Two Syncs at once on one DLQ (small batches, so they interleave) number
// every letter once: 200 letters, IDs 0..199, none lost, none twice.
func TestAMQPConcurrentSyncsNumberEachLetterOnce(t *testing.T) {
	t.Parallel()
	r := setupRabbit(t)
	ctx := context.Background()
	const n = 200
	now := time.Now()
	for i := range n {
		r.exhausted(t, "e-"+strconv.Itoa(i), now)
	}
	testkit.Eventually(t, 10*time.Second, "200 letters in the DLQ", func() bool { return r.onBroker(t) == n })
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range 2 {
		b := r.backend(t, 7)
		wg.Add(1)
		go func() { defer wg.Done(); _, errs[i] = b.Sync(ctx, r.store) }()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	ls := r.indexed(t)
	events, offsets := map[string]bool{}, map[int64]bool{}
	for _, l := range ls {
		events[l.EventID], offsets[l.Offset] = true, true
	}
	if len(ls) != n || len(events) != n || len(offsets) != n || r.onBroker(t) != 0 {
		t.Fatalf("%d letters, %d events, %d offsets, %d on the broker; want %d, %d, %d, 0",
			len(ls), len(events), len(offsets), r.onBroker(t), n, n, n)
	}
	for i := range int64(n) {
		if !offsets[i] {
			t.Fatalf("sequence has a gap at %d", i)
		}
	}
}
