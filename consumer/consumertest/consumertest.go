// Package consumertest is the conformance suite every consumer source runs
// (like Watermill's pubsub tests): the consumer's guarantees, proven once,
// against the real broker and PostgreSQL, for kafka.NewSource and
// amqp.NewSource. The pipeline (package consumer) is the same for both; the
// suite proves that each source carries its decisions out the same way, on
// the wire included: a dead letter carries the same headers, in the same
// encodings, on either broker.
//
// A harness runs against kfake or the machine's RabbitMQ by default, and
// against external brokers when KM0_TEST_KAFKA_BROKERS or KM0_TEST_AMQP_URL
// names them (docs/conformance.md).
package consumertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/schema"
	"github.com/km0/km0/transport"
)

// Features says what a broker's wire can carry; a case that needs what is
// off is skipped with the reason.
type Features struct {
	// RepeatedHeaders: a message can carry two headers of one name (Kafka).
	// Off on RabbitMQ, whose headers are a table.
	RepeatedHeaders bool
	// OrderPerKey: events of one key are handled in their order (Kafka; a
	// RabbitMQ source in ordered mode). NoOrderPerKey says why it is off.
	OrderPerKey   bool
	NoOrderPerKey string
	// PermanentLettersCarryReason: the dead letter of a permanent failure
	// carries motiu and intents (Kafka's copy). Off on RabbitMQ, where the
	// contract makes it a native nack to the DLX (x-death says "rejected"):
	// the reason is then checked through Config.OnDeadLetter only, as on
	// every broker.
	PermanentLettersCarryReason bool
	// DeadLetterExtra are header names a broker's dead letters carry beyond
	// the contract's (e.g. RabbitMQ's clau and cua_origen, which hold what
	// Kafka keeps in the record itself).
	DeadLetterExtra []string
	// PerKeyEvents is the size of the per-key order case over many keys
	// (events; a tenth as many keys, 1% failing once). Default 1000.
	PerKeyEvents int
}

// Broker is one fresh input of the broker under test: a Kafka topic with its
// .retry and .dlq, or a RabbitMQ work queue with its wait queues and DLQ.
type Broker struct {
	// Publish puts messages on the input as a producer does (Message.Topic
	// is ignored), confirmed.
	Publish func(t testing.TB, msgs ...*transport.Message)
	// PublishRetryCopy puts m where the source reads its own retry copies
	// (Kafka: <topic>.retry; RabbitMQ: the work queue, as a copy back from
	// a wait queue), with m's headers exactly as given: a forged copy.
	PublishRetryCopy func(t testing.TB, m *transport.Message)
	// Source returns a new source reading the input as the consumer group
	// or queue of the test; each call is a new process of the same consumer.
	Source func(t *testing.T) transport.Source
	// Pending returns how many messages of the input are not settled
	// (Kafka: the domain topic's end offsets minus the group's committed
	// ones; RabbitMQ: the messages ready on the work queues). The suite
	// asks only while no consumer of the input runs.
	Pending func(t testing.TB) int
	// DeadLetters waits until the input's DLQ holds at least n letters
	// (or a timeout) and returns every one read so far, headers as strings.
	DeadLetters func(t testing.TB, n int) []*transport.Message
}

// Harness is one broker under test.
type Harness struct {
	Features Features
	// New returns a fresh input; everything it creates goes at cleanup.
	New func(t *testing.T) Broker
	// Only, when set, names the cases to run (by subtest name); Run fails
	// on a name it does not know. For a variant of a broker already run in
	// full that changes only how clients connect (another SASL mechanism):
	// a few cases that use every client the consumer builds are enough.
	Only []string
}

// Run runs every proof as a subtest (those of Harness.Only, if set).
func Run(t *testing.T, h Harness) {
	cases := []struct {
		name string
		fn   func(t *testing.T, w *world)
	}{
		{"DuplicatesAreAbsorbed", duplicates},
		{"CrashAfterCommitBeforeSettleIsAbsorbedAsADuplicate", crashAfterCommit},
		{"CrashMidTransactionLeavesNothingAndProcessesOnceLater", crashMidTx},
		{"CrashAfterRetryCopyBeforeSettleAppliesOnce", crashAfterCopy},
		{"BusinessFailureRollsBackTheKeyAndDeadLetters", businessFailure},
		{"PoisonIsDeadLetteredAtTheFirstAttempt", poison},
		{"TransientIsRetriedWithBackoffThenDeadLetteredWithTheContractHeaders", transientExhausted},
		{"OrderPerKeyIsKept", orderPerKey},
		{"PanicIsATransientAttempt", panicTransient},
		{"UnknownTipusIsIgnored", unknownTipus},
		{"DatabaseOutageNeverSpendsAnAttempt", dbOutage},
		{"SchemaValidationAndUpcasting", schemaDecode},
		{"DualPublishedPairIsHandledOnce", dualPair},
		{"CleanStopCommitsFinishedWork", cleanStop},
		{"ForgedRetryHeadersAreClamped", forgedRetry},
		{"TipusHeaderThatDisagreesWithTheEnvelopeIsDeadLettered", tipusDisagrees},
		{"PerKeyCancellationIsAppliedAfterItsRetriedCreation", perKeyCancellation},
		{"PerKeyDeadHeadDeadLettersTheSequenceAndItsReplayReleasesIt", perKeyDeadLetterBlocked},
		{"PerKeyDeadHeadKeepsTheSequenceParkedUntilItsReplay", perKeyStayParked},
		{"PerKeyCrashWhileParkingLosesNothing", perKeyCrashParking},
		{"PerKeyCrashWhileReleasingAppliesNothingTwice", perKeyCrashReleasing},
		{"PerKeyCrashAfterMarkingTheHeadBeforeItsCopy", perKeyCrashMarking},
		{"PerKeyCrashAfterAReleasedMessageFailedBeforeItsCopy", perKeyCrashReleasedFailure},
		{"PerKeyManyKeysWithTransientFailuresKeepEventOrder", perKeyMany},
		{"PerKeyFinalRefusalIsDeadLetteredWithoutBlockingItsKey", perKeyFinalRefusal},
		{"PerKeyBatchHandlerRefusalBlocksItsKey", perKeyBatchRefusal},
	}
	found := map[string]bool{} // of Harness.Only: whether a case has the name
	for _, n := range h.Only {
		found[n] = false
	}
	for _, c := range cases {
		if len(h.Only) > 0 {
			if _, ok := found[c.name]; !ok {
				continue
			}
			found[c.name] = true
		}
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.fn(t, newWorld(t, h))
		})
	}
	for n, ok := range found {
		if !ok {
			t.Errorf("consumertest: no case named %q", n)
		}
	}
}

// deadLetterHeaders are the contract headers every dead letter of an
// exhausted retry carries, on either broker: the event's, the attempts and
// reason, the first failure's origin, time and consumer group, and the
// attempt history.
var deadLetterHeaders = []string{
	contract.HeaderType, contract.HeaderEventID, contract.HeaderAttempts, contract.HeaderReason,
	contract.HeaderLastError, contract.HeaderOriginalTopic, contract.HeaderOriginalPartition,
	contract.HeaderOriginalOffset, contract.HeaderFirstFailure, contract.HeaderGroup,
	contract.HeaderOriginalTime, contract.HeaderDeadAt, contract.HeaderHistory,
}

const (
	tipus = "comanda.creada"
	name  = "inventari.descompte_estoc"
)

// world is one case's broker input, schema and consumer settings.
type world struct {
	t  *testing.T
	h  Harness
	b  Broker
	db *pgtest.Schema
	// label is the source's Label (grup_consumidor of its copies).
	label string
	// reasons holds the motiu Config.OnDeadLetter observed, by event id.
	reasons sync.Map
	log     *testlog.Buffer
	reg     *prometheus.Registry
}

func newWorld(t *testing.T, h Harness) *world {
	db := pgtest.NewSchema(t)
	ctx := context.Background()
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), migrate.Inbox, keyorder.Migrations); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE efectes (seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, clau TEXT NOT NULL, n INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return &world{t: t, h: h, b: h.New(t), db: db, log: &testlog.Buffer{}, reg: prometheus.NewRegistry()}
}

// config is a consumer of the world's input with test timings.
func (w *world) config(h consumer.Handler) consumer.Config {
	src := w.b.Source(w.t)
	w.label = src.Label()
	return consumer.Config{
		Source: src, Name: name, Pool: w.db.Pool, Names: w.db.Names(), Handle: h,
		Types: []string{tipus}, Backoff: 30 * time.Millisecond, BackoffMax: time.Second, MaxAttempts: 3,
		ShutdownTimeout: 10 * time.Second, Metrics: w.reg,
		Logger: slog.New(slog.NewTextHandler(w.log, nil)),
		OnDeadLetter: func(_ context.Context, m *consumer.Message, motiu string) {
			w.reasons.Store(id(m.Message), motiu)
		},
	}
}

// permanentLetters checks that dead holds exactly the events of want (by
// id), each dead-lettered at its first attempt with its motiu: observed by
// OnDeadLetter on every broker, and on the letter itself where the broker
// carries it.
func (w *world) permanentLetters(t *testing.T, dead []*transport.Message, want map[string]string) {
	t.Helper()
	if len(dead) != len(want) {
		t.Fatalf("%d dead letters, want %d", len(dead), len(want))
	}
	for _, d := range dead {
		motiu, ok := want[id(d)]
		if !ok {
			t.Fatalf("dead letter %s was not expected", id(d))
		}
		if got, _ := w.reasons.Load(id(d)); got != motiu {
			t.Errorf("dead letter %s: OnDeadLetter saw motiu %q\nwant %q", id(d), got, motiu)
		}
		if !w.h.Features.PermanentLettersCarryReason {
			continue
		}
		got, _ := d.Header(contract.HeaderReason)
		intents, _ := d.Header(contract.HeaderAttempts)
		if got != motiu || intents != "1" {
			t.Errorf("dead letter %s: motiu %q intents %q\nwant motiu %q at attempt 1", id(d), got, intents, motiu)
		}
	}
}

type running struct {
	c      *consumer.Consumer
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

// run starts a consumer with the crash points hooks; it stops at cleanup.
func (w *world) run(cfg consumer.Config, hooks faults.Consumer[*consumer.Message]) *running {
	w.t.Helper()
	c, err := consumer.New(cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(faults.WithConsumer(context.Background(), hooks))
	r := &running{c: c, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	w.t.Cleanup(func() { _ = r.stop() })
	return r
}

func (r *running) stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(30 * time.Second):
			r.err = errors.New("Run did not return within 30 s of cancel")
		}
	})
	return r.err
}

// crashed waits for Run to return on its own and fails unless it crashed.
func (r *running) crashed(t *testing.T) {
	t.Helper()
	r.once.Do(func() {
		select {
		case r.err = <-r.done:
		case <-time.After(30 * time.Second):
			r.err = errors.New("Run did not return within 30 s of the crash point")
		}
	})
	if !errors.Is(r.err, faults.ErrCrashed) {
		t.Fatalf("Run returned %v, want the crash", r.err)
	}
}

// dades is the payload of the suite's events: a schema-valid comanda.creada
// (v2) whose id is the key and whose n numbers it within the key.
type dades struct {
	ID     string  `json:"id"`
	Client string  `json:"client"`
	Mercat string  `json:"mercat"`
	Linies []linia `json:"linies"`
	N      int     `json:"n,omitempty"`
}

type linia struct {
	Producte  string `json:"producte"`
	Quantitat int    `json:"quantitat"`
	Preu      int    `json:"preu_centims"`
}

// ev returns an event of key numbered n, with a fresh id.
func ev(key string, n int) *transport.Message { return evWith(key, n, uuid.NewString(), 1, "") }

func evWith(key string, n int, id string, versio int, correlacio string) *transport.Message {
	d, _ := json.Marshal(dades{ID: key, Client: "anna", Mercat: "girona", N: n,
		Linies: []linia{{Producte: "formatge-curat", Quantitat: 1, Preu: 1450}}})
	e := &envelope.Envelope{ID: id, Type: tipus, Version: versio, TimeMS: 1789000000000, Origin: "comandes", Data: d}
	if correlacio != "" {
		c, _ := json.Marshal(correlacio)
		e.Extra = map[string]json.RawMessage{"correlacio": c}
	}
	v, err := e.Encode()
	if err != nil {
		panic(err)
	}
	return &transport.Message{Key: []byte(key), Value: v, Headers: []transport.Header{
		{Key: contract.HeaderType, Value: tipus}, {Key: contract.HeaderEventID, Value: id}}}
}

func id(m *transport.Message) string { v, _ := m.Header(contract.HeaderEventID); return v }

// effect records the event in efectes.
func effect(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var d dades
	if err := m.Envelope.DataAs(&d); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO efectes (id, clau, n) VALUES ($1, $2, $3)`, m.Envelope.ID, string(m.Key), d.N)
	return err
}

func (w *world) count(q string, args ...any) int {
	w.t.Helper()
	var n int
	if err := w.db.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		w.t.Fatal(err)
	}
	return n
}

func (w *world) effects() int { return w.count(`SELECT count(*) FROM efectes`) }
func (w *world) distinctEffects() int {
	return w.count(`SELECT count(DISTINCT id) FROM efectes`)
}
func (w *world) keys() int { return w.count(`SELECT count(*) FROM missatges_processats`) }

// pending waits until the input holds want unsettled messages (a broker
// may take a moment to requeue the deliveries of a dead consumer).
func (w *world) pending(t *testing.T, want int, when string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := w.b.Pending(t)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d messages unsettled on the input, want %d", when, got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// dlqTotal reads km0_dlq_total for the motiu class (contract.ReasonClass).
func (w *world) dlqTotal(class string) float64 {
	w.t.Helper()
	mfs, err := w.reg.Gather()
	if err != nil {
		w.t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != consumer.MetricDLQ {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "motiu" && l.GetValue() == class {
					sum += m.GetCounter().GetValue()
				}
			}
		}
	}
	return sum
}

// logged reports whether one log line holds every part.
func (w *world) logged(parts ...string) bool {
	for _, line := range strings.Split(w.log.String(), "\n") {
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

// runUntil runs a consumer until done holds, stops it cleanly and returns
// its stats.
func (w *world) runUntil(cfg consumer.Config, what string, done func(consumer.Stats) bool) consumer.Stats {
	w.t.Helper()
	r := w.run(cfg, faults.Consumer[*consumer.Message]{})
	testkit.Eventually(w.t, 30*time.Second, what, func() bool { return done(r.c.Stats()) })
	if err := r.stop(); err != nil {
		w.t.Fatal(err)
	}
	return r.c.Stats()
}

// Every event published twice, half of them back to back (one fetch) and
// half again at the end: the end state is that of each published once, and
// every delivery is settled.
func duplicates(t *testing.T, w *world) {
	var evs, msgs []*transport.Message
	for i := range 40 {
		evs = append(evs, ev(fmt.Sprintf("K%d", i%7), i))
	}
	for i, m := range evs {
		msgs = append(msgs, m)
		if i%2 == 0 {
			msgs = append(msgs, m) // back to back
		}
	}
	for i, m := range evs {
		if i%2 == 1 {
			msgs = append(msgs, m) // much later
		}
	}
	w.b.Publish(t, msgs...)
	st := w.runUntil(w.config(effect), "80 deliveries finished", func(s consumer.Stats) bool { return s.Processed+s.Duplicates == 80 })
	if st.Processed != 40 || st.Duplicates != 40 || w.effects() != 40 || w.distinctEffects() != 40 || w.keys() != 40 {
		t.Fatalf("stats %+v, %d effects, %d keys; want 40 processed, 40 duplicates, 40 effects, 40 keys", st, w.effects(), w.keys())
	}
	w.pending(t, 0, "after a clean stop")
}

// Crash point: after the transaction committed and before the source
// settled (offset commit, ack). The redelivery is absorbed as a duplicate:
// one effect, one key.
func crashAfterCommit(t *testing.T, w *world) {
	m := ev("P-1", 1)
	w.b.Publish(t, m)
	r := w.run(w.config(effect), faults.Consumer[*consumer.Message]{
		AfterCommit: func(context.Context, []*consumer.Message) error { return faults.ErrCrashed },
	})
	r.crashed(t)
	if w.effects() != 1 || w.keys() != 1 {
		t.Fatalf("%d effects and %d keys after the commit, want 1 and 1", w.effects(), w.keys())
	}
	w.pending(t, 1, "after the crash")
	st := w.runUntil(w.config(effect), "the redelivery", func(s consumer.Stats) bool { return s.Duplicates == 1 })
	if st.Processed != 0 || w.effects() != 1 || w.keys() != 1 {
		t.Fatalf("after the restart: stats %+v, %d effects, %d keys; want the redelivery a duplicate, 1 effect, 1 key", st, w.effects(), w.keys())
	}
	w.pending(t, 0, "after the duplicate")
}

// Crash point: inside the transaction, after the handler and before COMMIT.
// Nothing of it stays; the restarted consumer applies it once.
func crashMidTx(t *testing.T, w *world) {
	w.b.Publish(t, ev("P-1", 1))
	var inside atomic.Int64
	r := w.run(w.config(effect), faults.Consumer[*consumer.Message]{
		BeforeTxCommit: func(ctx context.Context, tx pgx.Tx, _ []*consumer.Message) error {
			var n int64
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM efectes`).Scan(&n); err != nil {
				return err
			}
			inside.Store(n)
			return faults.ErrCrashed
		},
	})
	r.crashed(t)
	if inside.Load() != 1 {
		t.Fatalf("inside the transaction %d effects, want 1 (the handler ran)", inside.Load())
	}
	if w.effects() != 0 || w.keys() != 0 {
		t.Fatalf("%d effects and %d keys after a crash before COMMIT, want none", w.effects(), w.keys())
	}
	w.pending(t, 1, "after the crash")
	st := w.runUntil(w.config(effect), "the redelivery processed", func(s consumer.Stats) bool { return s.Processed == 1 })
	if st.Duplicates != 0 || w.effects() != 1 || w.keys() != 1 {
		t.Fatalf("stats %+v, %d effects, %d keys; want 1 effect and 1 key", st, w.effects(), w.keys())
	}
	w.pending(t, 0, "after the redelivery")
}

// Crash point: after the broker confirmed a failure's retry copy and before
// the original was settled. Both the original and the copy come back; the
// effect is applied once.
func crashAfterCopy(t *testing.T, w *world) {
	w.b.Publish(t, ev("P-1", 1))
	failing := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := effect(ctx, tx, m); err != nil {
			return err
		}
		return outcome.Transient(errors.New("mapes: 503"))
	}
	// The copy is due after BackoffMax (1 s), not 30 ms: the simulated crash
	// stops the other lanes a moment after the hook, and on a loaded machine a
	// copy due sooner was handled (and copied again) within that moment.
	cfg := w.config(failing)
	cfg.Backoff = cfg.BackoffMax
	r := w.run(cfg, faults.Consumer[*consumer.Message]{
		BeforeSourceCommit: func(context.Context, int) error { return faults.ErrCrashed },
	})
	r.crashed(t)
	if st := r.c.Stats(); st.Retried != 1 {
		t.Fatalf("first consumer %+v: the retry copy was not confirmed", st)
	}
	w.pending(t, 1, "the original after the crash")
	st := w.runUntil(w.config(effect), "the original and its copy handled", func(s consumer.Stats) bool {
		return s.Processed+s.Duplicates == 2
	})
	if st.Processed != 1 || st.Duplicates != 1 || w.effects() != 1 || w.keys() != 1 || st.DeadLettered != 0 {
		t.Fatalf("stats %+v, %d effects, %d keys; want 1 processed, 1 duplicate, 1 effect, 1 key", st, w.effects(), w.keys())
	}
	w.pending(t, 0, "after both")
}

// A business failure (outcome.Permanent) after the handler wrote its effect:
// the effect and the key roll back, the event is dead-lettered at once with a
// permanent motiu, and its neighbours are processed.
func businessFailure(t *testing.T, w *world) {
	a, bad, c := ev("P-7", 1), ev("P-7", 2), ev("P-7", 3) // one key: one lane, likely one transaction batch
	w.b.Publish(t, a, bad, c)
	st := w.runUntil(w.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := effect(ctx, tx, m); err != nil { // the effect is written before the failure
			return err
		}
		if m.Envelope.ID == id(bad) {
			return outcome.Permanentf("estoc insuficient: formatge-curat")
		}
		return nil
	}), "2 processed, 1 dead-lettered", func(s consumer.Stats) bool { return s.Processed == 2 && s.DeadLettered == 1 })
	if st.Retried != 0 || w.effects() != 2 || w.count(`SELECT count(*) FROM efectes WHERE id = $1`, id(bad)) != 0 ||
		w.count(`SELECT count(*) FROM missatges_processats WHERE id_missatge = $1`, id(bad)) != 0 || w.keys() != 2 {
		t.Fatalf("stats %+v, %d effects, %d keys; want the failed event's effect and key rolled back, its neighbours' kept", st, w.effects(), w.keys())
	}
	dead := w.b.DeadLetters(t, 1)
	w.permanentLetters(t, dead, map[string]string{id(bad): contract.ReasonPermanent + "estoc insuficient: formatge-curat"})
	if string(dead[0].Key) != "P-7" || string(dead[0].Value) != string(bad.Value) {
		t.Fatalf("dead letter key %q body %q, want the event's", dead[0].Key, dead[0].Value)
	}
	if got := w.dlqTotal("permanent: estoc insuficient"); got != 1 {
		t.Fatalf("km0_dlq_total{motiu=\"permanent: estoc insuficient\"} = %v, want 1", got)
	}
	w.pending(t, 0, "after a clean stop")
}

// An undecodable message is dead-lettered at its first attempt, its handler
// never runs, and the messages behind it flow.
func poison(t *testing.T, w *world) {
	bad := &transport.Message{Key: []byte("K"), Value: []byte(`{"id_esdeveniment": "verinos-1", "tipus": "comanda.creada", `),
		Headers: []transport.Header{{Key: contract.HeaderType, Value: tipus}, {Key: contract.HeaderEventID, Value: "verinos-1"}}}
	msgs := []*transport.Message{bad}
	for i := range 200 {
		msgs = append(msgs, ev("K", i))
	}
	w.b.Publish(t, msgs...)
	cfg := w.config(effect)
	cfg.Backoff = time.Hour // had anything waited for a retry, the case would time out
	st := w.runUntil(cfg, "200 processed, 1 dead-lettered", func(s consumer.Stats) bool { return s.Processed == 200 && s.DeadLettered == 1 })
	if st.Retried != 0 || w.effects() != 200 {
		t.Fatalf("stats %+v, %d effects: want none retried, 200 effects", st, w.effects())
	}
	if w.h.Features.OrderPerKey {
		if n := w.count(`SELECT count(*) FROM (SELECT n, lag(n) OVER (ORDER BY seq) AS prev FROM efectes) x WHERE n <> prev + 1`); n != 0 {
			t.Fatalf("%d effects out of order behind the poison message", n)
		}
	}
	dead := w.b.DeadLetters(t, 1)
	if len(dead) != 1 || string(dead[0].Value) != string(bad.Value) {
		t.Fatalf("%d dead letters, want the poison message with its body", len(dead))
	}
	motiu, _ := w.reasons.Load("verinos-1")
	if s, _ := motiu.(string); !strings.HasPrefix(s, contract.ReasonPermanent+"envelope: malformed JSON") {
		t.Fatalf("motiu %q, want a permanent envelope failure", motiu)
	}
	w.permanentLetters(t, dead, map[string]string{"verinos-1": motiu.(string)})
	if got := w.dlqTotal("permanent: envelope"); got != 1 {
		t.Fatalf("km0_dlq_total{motiu=\"permanent: envelope\"} = %v, want 1", got)
	}
	if !w.logged(`level=ERROR msg="consumer: dead letter"`, " id=verinos-1 ", `motiu="permanent: envelope: malformed JSON`) {
		t.Fatalf("no error log line for the dead letter:\n%s", w.log.String())
	}
}

// A transient failure is retried after growing delays and, at MaxAttempts,
// dead-lettered. The letter carries the contract's headers, each in its one
// encoding: the same on both brokers.
func transientExhausted(t *testing.T, w *world) {
	m := ev("P-1", 1)
	w.b.Publish(t, m)
	var mu sync.Mutex
	var at []time.Time
	var attempts []int
	start := time.Now()
	st := w.runUntil(w.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		at, attempts = append(at, time.Now()), append(attempts, m.Attempt)
		mu.Unlock()
		if err := effect(ctx, tx, m); err != nil { // written, then rolled back by the failure
			return err
		}
		return errors.New("mapes: 503 Service Unavailable") // unclassified: transient by default
	}), "dead-lettered after 3 attempts", func(s consumer.Stats) bool { return s.DeadLettered == 1 })
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(attempts) != "[1 2 3]" || st.Retried != 2 || st.Processed != 0 || w.effects() != 0 || w.keys() != 0 {
		t.Fatalf("attempts %v, stats %+v, %d effects, %d keys; want attempts 1, 2, 3, 2 retries, nothing kept",
			attempts, st, w.effects(), w.keys())
	}
	if got := w.dlqTotal("transitori esgotat: mapes"); got != 1 {
		t.Fatalf("km0_dlq_total{motiu=\"transitori esgotat: mapes\"} = %v, want 1", got)
	}
	if !w.logged(`level=ERROR msg="consumer: dead letter"`, " id="+id(m)+" ", `motiu="transitori esgotat: mapes: 503`) {
		t.Fatalf("no error log line for the dead letter:\n%s", w.log.String())
	}
	// Backoff 30 ms then 60 ms: each attempt waits at least its delay.
	for i, d := range []time.Duration{30 * time.Millisecond, 60 * time.Millisecond} {
		if gap := at[i+1].Sub(at[i]); gap < d {
			t.Fatalf("attempt %d ran %v after attempt %d, want at least %v", i+2, gap, i+1, d)
		}
	}
	dead := w.b.DeadLetters(t, 1)
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	d := dead[0]
	if string(d.Key) != "P-1" || string(d.Value) != string(m.Value) {
		t.Fatalf("dead letter key %q body %q, want the event's", d.Key, d.Value)
	}
	// The header set: the contract's, plus only what the broker declares.
	var names []string
	for _, h := range d.Headers {
		if !slices.Contains(w.h.Features.DeadLetterExtra, h.Key) && !strings.HasPrefix(h.Key, "x-") {
			names = append(names, h.Key)
		}
	}
	slices.Sort(names)
	want := slices.Clone(deadLetterHeaders)
	slices.Sort(want)
	if !slices.Equal(slices.Compact(names), want) || len(names) != len(want) {
		t.Fatalf("dead letter headers %q, want exactly %q (plus the broker's %q)", names, want, w.h.Features.DeadLetterExtra)
	}
	get := func(k string) string { v, _ := d.Header(k); return v }
	if get(contract.HeaderType) != tipus || get(contract.HeaderEventID) != id(m) || get(contract.HeaderAttempts) != "3" ||
		get(contract.HeaderReason) != contract.ReasonExhausted+"mapes: 503 Service Unavailable" ||
		get(contract.HeaderGroup) != w.label || get(contract.HeaderOriginalTopic) == "" {
		t.Fatalf("dead letter headers %q (source label %q)", d.Headers, w.label)
	}
	if v := get(contract.HeaderLastError); v != "mapes: 503 Service Unavailable" {
		t.Fatalf("ultim_error %q", v)
	}
	if v, ok := d.Header(contract.HeaderNotBefore); ok {
		t.Fatalf("a dead letter carries no_abans %q", v)
	}
	for _, k := range []string{contract.HeaderOriginalPartition, contract.HeaderOriginalOffset} {
		if v := get(k); v == "" || strings.TrimLeft(v, "-0123456789") != "" {
			t.Fatalf("%s %q: want a decimal integer", k, v)
		}
	}
	// Time headers: unix seconds as a decimal string with 6 decimals
	// (contract.FormatTime), times of this run.
	for _, k := range []string{contract.HeaderFirstFailure, contract.HeaderOriginalTime, contract.HeaderDeadAt} {
		v := get(k)
		ts, err := contract.ParseTime(v)
		if err != nil || v != contract.FormatTime(ts) || ts.Before(start.Add(-5*time.Second)) || ts.After(time.Now().Add(time.Second)) {
			t.Fatalf("%s %q: want unix seconds (contract.FormatTime) of this run (%v)", k, v, err)
		}
	}
	if ff, _ := contract.ParseTime(get(contract.HeaderFirstFailure)); ff.Sub(at[0]).Abs() > time.Second {
		t.Fatalf("primera_fallada %v, the first attempt failed at %v", ff, at[0])
	}
	// The attempt history: the three attempts, each with its error, each
	// after the handler ran it.
	hist := contract.ParseHistory(get(contract.HeaderHistory))
	if len(hist) != 3 {
		t.Fatalf("historial_intents %q: %d attempts, want 3", get(contract.HeaderHistory), len(hist))
	}
	for i, a := range hist {
		if a.N != i+1 || a.Error != "mapes: 503 Service Unavailable" || a.At.Before(at[i].Add(-time.Millisecond)) ||
			(i > 0 && !a.At.After(hist[i-1].At)) {
			t.Fatalf("historial_intents attempt %d: %+v, want attempt %d with its error, after %v and the one before", i, a, i+1, at[i])
		}
	}
	all := make([]string, len(d.Headers))
	for i, h := range d.Headers {
		all[i] = h.Key
	}
	slices.Sort(all)
	t.Logf("dead letter headers: %q", all)
}

// Events of one key are handled in their order, across keys interleaved.
func orderPerKey(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	var msgs []*transport.Message
	for i := range 60 {
		msgs = append(msgs, ev(fmt.Sprintf("K%d", i%3), i/3))
	}
	w.b.Publish(t, msgs...)
	w.runUntil(w.config(effect), "60 processed", func(s consumer.Stats) bool { return s.Processed == 60 })
	rows, err := w.db.Pool.Query(context.Background(), `SELECT clau, n FROM efectes ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	next := map[string]int{}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			t.Fatal(err)
		}
		if n != next[k] {
			t.Fatalf("key %s: event %d handled when %d was due", k, n, next[k])
		}
		next[k]++
	}
	if rows.Err() != nil || next["K0"]+next["K1"]+next["K2"] != 60 {
		t.Fatalf("%v handled per key, want 20 each (%v)", next, rows.Err())
	}
}

// A handler panic is one failed, transient attempt: retried, then applied
// once.
func panicTransient(t *testing.T, w *world) {
	w.b.Publish(t, ev("P-1", 1), ev("P-1", 2))
	st := w.runUntil(w.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Attempt == 1 {
			var mp map[string]int
			mp["boom"]++ // nil map: panics
		}
		return effect(ctx, tx, m)
	}), "both processed at their second attempt", func(s consumer.Stats) bool { return s.Processed == 2 })
	if st.Panics != 2 || st.Retried != 2 || st.DeadLettered != 0 || w.effects() != 2 {
		t.Fatalf("stats %+v, %d effects; want 2 panics, 2 retries, 2 effects", st, w.effects())
	}
	if logs := w.log.String(); !strings.Contains(logs, `msg="consumer: handler panic"`) || !strings.Contains(logs, "goroutine ") {
		t.Fatalf("panic not logged with its stack:\n%s", logs)
	}
}

// An event of a tipus the consumer does not handle is settled without
// running the handler, counted as ignored, and leaves no key.
func unknownTipus(t *testing.T, w *world) {
	other := ev("P-1", 1)
	other.SetHeader(contract.HeaderType, "comanda.pagada")
	w.b.Publish(t, other, ev("P-1", 2))
	var handled sync.Map
	st := w.runUntil(w.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		handled.Store(m.Envelope.ID, true)
		return effect(ctx, tx, m)
	}), "1 ignored, 1 processed", func(s consumer.Stats) bool { return s.Ignored == 1 && s.Processed == 1 })
	if _, ok := handled.Load(id(other)); ok || st.DeadLettered != 0 || st.Retried != 0 || w.keys() != 1 {
		t.Fatalf("stats %+v, %d keys; want the other tipus ignored, unhandled, without a key", st, w.keys())
	}
	w.pending(t, 0, "the ignored event settled too")
}

// The database refuses connections while a message is due: the message
// waits in place, unsettled, for longer than its attempts' backoff, never
// spends an attempt and never reaches the DLQ; once the database is back
// its effect is applied once, at attempt 1.
func dbOutage(t *testing.T, w *world) {
	var down atomic.Bool
	var refused atomic.Int64
	down.Store(true)
	pcfg, err := pgxpool.ParseConfig(w.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 2
	pcfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		if down.Load() {
			refused.Add(1)
			return errors.New("connection refused (simulated restart)")
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var attempts []int
	var mu sync.Mutex
	cfg := w.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		attempts = append(attempts, m.Attempt)
		mu.Unlock()
		return effect(ctx, tx, m)
	})
	cfg.Pool = pool
	r := w.run(cfg, faults.Consumer[*consumer.Message]{})
	w.b.Publish(t, ev("P-1", 1))
	// Past 3 attempts' worth of backoff (30 + 60 ms).
	testkit.Eventually(t, 30*time.Second, "6 refused connections", func() bool { return refused.Load() >= 6 })
	if st := r.c.Stats(); st.Retried != 0 || st.DeadLettered != 0 {
		t.Fatalf("stats %+v during the outage: an attempt was spent", st)
	}
	down.Store(false)
	testkit.Eventually(t, 30*time.Second, "the effect after the outage", func() bool { return r.c.Stats().Processed == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if st := r.c.Stats(); st.Retried != 0 || st.DeadLettered != 0 || w.effects() != 1 || fmt.Sprint(attempts) != "[1]" {
		t.Fatalf("stats %+v, %d effects, attempts %v; want 1 effect at attempt 1", st, w.effects(), attempts)
	}
}

// With the schema decoder, a v1 event is validated and upcast to the v2 the
// handler is written against, and an event that breaks its schema is a
// permanent esquema failure, dead-lettered at once.
func schemaDecode(t *testing.T, w *world) {
	dec, err := newDecoder()
	if err != nil {
		t.Fatal(err)
	}
	good := evWith("P-1", 1, uuid.NewString(), 1, "")
	broken := evWith("P-2", 2, uuid.NewString(), 1, "")
	broken.Value = []byte(strings.Replace(string(broken.Value), `"quantitat":1`, `"quantitat":0`, 1))
	w.b.Publish(t, good, broken)
	var versions sync.Map
	cfg := w.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		versions.Store(m.Envelope.ID, m.Envelope.Version)
		return effect(ctx, tx, m)
	})
	cfg.Decode = dec
	st := w.runUntil(cfg, "1 processed, 1 dead-lettered", func(s consumer.Stats) bool { return s.Processed == 1 && s.DeadLettered == 1 })
	if v, _ := versions.Load(id(good)); v != 2 || st.Retried != 0 {
		t.Fatalf("the v1 event reached the handler as versio %v (stats %+v), want 2", v, st)
	}
	motiu, _ := w.reasons.Load(id(broken))
	if s, _ := motiu.(string); !strings.HasPrefix(s, contract.ReasonPermanent+"esquema: ") || !strings.Contains(s, "/linies/0/quantitat") {
		t.Fatalf("motiu %q, want a permanent esquema failure naming the field", motiu)
	}
	w.permanentLetters(t, w.b.DeadLetters(t, 1), map[string]string{id(broken): motiu.(string)})
}

// The two copies of a dual-published pair (each its own id, one shared
// correlacio) have the effect once.
func dualPair(t *testing.T, w *world) {
	corr := uuid.NewString()
	w.b.Publish(t, evWith("P-1", 1, uuid.NewString(), 2, corr), evWith("P-1", 1, uuid.NewString(), 1, corr))
	st := w.runUntil(w.config(effect), "both copies", func(s consumer.Stats) bool { return s.Processed+s.Duplicates == 2 })
	if st.Processed != 1 || st.Duplicates != 1 || w.effects() != 1 ||
		w.count(`SELECT count(*) FROM missatges_processats WHERE id_missatge = $1`, corr) != 1 {
		t.Fatalf("stats %+v, %d effects; want the pair handled once under its correlacio", st, w.effects())
	}
}

// A clean stop while messages are handled settles the finished ones: a
// restarted consumer finds no duplicate of anything the first one applied.
func cleanStop(t *testing.T, w *world) {
	var msgs []*transport.Message
	for i := range 30 {
		msgs = append(msgs, ev(fmt.Sprintf("K%d", i%3), i/3))
	}
	w.b.Publish(t, msgs...)
	r := w.run(w.config(effect), faults.Consumer[*consumer.Message]{})
	testkit.Eventually(t, 30*time.Second, "some processed", func() bool { return r.c.Stats().Processed >= 5 })
	if err := r.stop(); err != nil {
		t.Fatalf("clean stop: %v", err)
	}
	first := r.c.Stats().Processed
	if int(first) != w.effects() {
		t.Fatalf("%d processed, %d effects", first, w.effects())
	}
	w.pending(t, 30-int(first), "after the first clean stop")
	st := w.runUntil(w.config(effect), "the rest", func(s consumer.Stats) bool { return int(first+s.Processed) == 30 })
	if st.Duplicates != 0 || w.effects() != 30 || w.distinctEffects() != 30 {
		t.Fatalf("after the restart: stats %+v, %d effects; want no duplicate (the stop settled what it finished)", st, w.effects())
	}
	w.pending(t, 0, "after the second clean stop")
}

// A forged retry copy is trusted no further than the configuration:
// no_abans in the year 2100 or past any time waits BackoffMax at most,
// intents -7 is attempt 2, intents past MaxAttempts is the last attempt
// (its failure a dead letter with intents 3).
func forgedRetry(t *testing.T, w *world) {
	forge := func(n int, headers ...string) *transport.Message {
		m := ev("F", n)
		for i := 0; i < len(headers); i += 2 {
			m.SetHeader(headers[i], headers[i+1])
		}
		return m
	}
	y2100 := forge(0, contract.HeaderAttempts, "1", contract.HeaderNotBefore, "4102444800.000000")
	huge := forge(1, contract.HeaderAttempts, "1", contract.HeaderNotBefore, "1e300")
	neg := forge(2, contract.HeaderAttempts, "-7", contract.HeaderNotBefore, "NaN")
	many := forge(3, contract.HeaderAttempts, "1000000")
	var mu sync.Mutex
	attempt := map[string]int{}
	at := map[string]time.Time{}
	cfg := w.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		attempt[m.Envelope.ID], at[m.Envelope.ID] = m.Attempt, time.Now()
		mu.Unlock()
		if m.Envelope.ID == id(many) {
			return outcome.Transient(errors.New("mapes: 503"))
		}
		return effect(ctx, tx, m)
	})
	r := w.run(cfg, faults.Consumer[*consumer.Message]{})
	w.b.Publish(t, ev("warm", 0))
	testkit.Eventually(t, 30*time.Second, "the first event processed", func() bool { return r.c.Stats().Processed == 1 })
	published := time.Now()
	for _, m := range []*transport.Message{y2100, huge, neg, many} {
		w.b.PublishRetryCopy(t, m)
	}
	testkit.Eventually(t, 30*time.Second, "3 copies processed and 1 dead-lettered", func() bool {
		st := r.c.Stats()
		return st.Processed == 4 && st.DeadLettered == 1
	})

	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, m := range []*transport.Message{y2100, huge} {
		if d := at[id(m)].Sub(published); d > 20*time.Second {
			t.Errorf("copy %s handled %v after it was published: held past BackoffMax", id(m), d)
		}
	}
	want := map[string]int{id(y2100): 2, id(huge): 2, id(neg): 2, id(many): 3}
	for k, v := range want {
		if attempt[k] != v {
			t.Errorf("event %s on attempt %d, want %d", k, attempt[k], v)
		}
	}
	dead := w.b.DeadLetters(t, 1)
	if len(dead) != 1 || id(dead[0]) != id(many) {
		t.Fatalf("%d dead letters, want the copy past every attempt", len(dead))
	}
	if v, _ := dead[0].Header(contract.HeaderAttempts); v != "3" {
		t.Fatalf("dead letter intents %q, want 3 (MaxAttempts)", v)
	}
}

// A message whose tipus header disagrees with its envelope is dead-lettered
// as a permanent esquema failure with a reason, never dropped: a header that
// is not UTF-8, a handled header on an envelope of another tipus, and (where
// the wire can carry them) two tipus headers.
func tipusDisagrees(t *testing.T, w *world) {
	notUTF8 := ev("T", 1)
	notUTF8.SetHeader(contract.HeaderType, tipus+"\xff")
	other := ev("T", 2)
	other.Value = []byte(strings.Replace(string(other.Value), `"tipus":"`+tipus+`"`, `"tipus":"comanda.pagada"`, 1))
	want := map[string]string{
		id(notUTF8): `permanent: esquema: header tipus not UTF-8 "comanda.creada\xff" does not match the envelope's "comanda.creada"`,
		id(other):   `permanent: esquema: header tipus "comanda.creada" does not match the envelope's "comanda.pagada"`,
	}
	msgs := []*transport.Message{notUTF8, other}
	if w.h.Features.RepeatedHeaders {
		two := ev("T", 0)
		two.Headers = append([]transport.Header{{Key: contract.HeaderType, Value: "comanda.pagada"}}, two.Headers...)
		want[id(two)] = `permanent: esquema: header tipus ambiguous: "comanda.pagada" and "comanda.creada" does not match the envelope's "comanda.creada"`
		msgs = append(msgs, two)
	} else {
		t.Log("two tipus headers: not tested, the broker's headers are a table")
	}
	good := ev("T", 3)
	w.b.Publish(t, append(msgs, good)...)
	st := w.runUntil(w.config(effect), "every message finished", func(s consumer.Stats) bool {
		return int(s.DeadLettered) == len(msgs) && s.Processed == 1
	})
	if st.Ignored != 0 || st.Retried != 0 || w.effects() != 1 {
		t.Fatalf("stats %+v, %d effects", st, w.effects())
	}
	w.permanentLetters(t, w.b.DeadLetters(t, len(msgs)), want)
}

// newDecoder is inventari's schema decoder: comanda.creada v2, v1 upcast.
func newDecoder() (func([]byte) (*envelope.Envelope, error), error) {
	d, err := schema.NewDecoder(schema.DecoderConfig{
		Handles:   map[string]int{tipus: 2},
		Upcasters: map[schema.Key]schema.Upcaster{{Type: tipus, Version: 1}: schema.Bump},
	})
	if err != nil {
		return nil, err
	}
	return d.Decode, nil
}
