package consumertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
)

// The per-key order cases (consumer.PerKey): a cancellation never overtakes
// its order's creation, even while the creation waits for a retry or sits in
// the DLQ; other keys never wait; and a crash at each step of parking and
// releasing loses nothing and applies nothing twice.

const cancellada = "comanda.cancellada"

// evOf is an event of tipus t for key, numbered n within the key.
func evOf(t, key string, n int) *transport.Message {
	id := uuid.NewString()
	d, _ := json.Marshal(dades{ID: key, Client: "anna", Mercat: "girona", N: n,
		Linies: []linia{{Producte: "formatge-curat", Quantitat: 1, Preu: 1450}}})
	e := &envelope.Envelope{ID: id, Type: t, Version: 1, TimeMS: 1789000000000, Origin: "comandes", Data: d}
	v, err := e.Encode()
	if err != nil {
		panic(err)
	}
	return &transport.Message{Key: []byte(key), Value: v, Headers: []transport.Header{
		{Key: contract.HeaderType, Value: t}, {Key: contract.HeaderEventID, Value: id}}}
}

// perKey is a per-key order consumer of the world's input for both tipus.
func (w *world) perKey(h consumer.Handler) consumer.Config {
	cfg := w.config(h)
	cfg.Types = []string{tipus, cancellada}
	cfg.Order = consumer.PerKey
	return cfg
}

// order returns the n of each key's effects in the order they were applied.
func (w *world) order(t *testing.T) map[string][]int {
	t.Helper()
	rows, err := w.db.Pool.Query(context.Background(), `SELECT clau, n FROM efectes ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]int{}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			t.Fatal(err)
		}
		out[k] = append(out[k], n)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	return out
}

func (w *world) storeRows() (blocked, parked int) {
	return w.count(`SELECT count(*) FROM claus_bloquejades`), w.count(`SELECT count(*) FROM missatges_aparcats`)
}

func isID(ms []*consumer.Message, m *transport.Message) bool {
	return len(ms) > 0 && ms[0].Envelope != nil && ms[0].Envelope.ID == id(m)
}

// comanda.creada fails transiently twice, then succeeds; the
// comanda.cancellada behind it (same key) is parked and applied after it;
// another key, published after both, is applied before the creation's
// first retry.
func perKeyCancellation(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	creada, cancel, other := evOf(tipus, "P-1", 0), evOf(cancellada, "P-1", 1), evOf(tipus, "P-2", 0)
	w.b.Publish(t, creada, cancel, other)
	var fails atomic.Int64
	st := w.runUntil(w.perKey(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Envelope.ID == id(creada) && fails.Load() < 2 {
			fails.Add(1)
			return outcome.Transient(errors.New("estoc: 503"))
		}
		return effect(ctx, tx, m)
	}), "3 applied", func(s consumer.Stats) bool { return s.Processed+s.Released == 3 })
	order := w.order(t)
	if got := order["P-1"]; len(got) != 2 || got[0] != 0 || got[1] != 1 {
		t.Fatalf("P-1 effects %v, want the creation (0) then the cancellation (1)", got)
	}
	first := w.count(`SELECT min(seq) FROM efectes`)
	if w.count(`SELECT seq FROM efectes WHERE id = $1`, id(other)) != first {
		t.Fatalf("P-2 was not applied first: it waited for P-1's retries")
	}
	if st.Retried != 2 || st.Parked < 1 || st.Released != 1 || st.DeadLettered != 0 || w.effects() != 3 || w.keys() != 3 {
		t.Fatalf("stats %+v, %d effects, %d keys; want 2 retries, the cancellation parked and released, 3 effects and keys", st, w.effects(), w.keys())
	}
	if b, p := w.storeRows(); b != 0 || p != 0 {
		t.Fatalf("%d blocked keys, %d parked messages left, want none", b, p)
	}
	w.pending(t, 0, "after a clean stop")
}

// A poison head is dead-lettered at its first attempt; the messages behind
// it are dead-lettered as blocked by it (DeadLetterBlocked) or stay parked
// (StayParked), and are applied in order when the head is replayed.
func perKeyDeadHead(t *testing.T, w *world, behind consumer.Behind) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	head, b1, b2 := evOf(tipus, "P-9", 0), evOf(cancellada, "P-9", 1), evOf(tipus, "P-9", 2)
	w.b.Publish(t, head, b1, b2, evOf(tipus, "P-8", 0))
	var poison atomic.Bool
	poison.Store(true)
	h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Envelope.ID == id(head) && poison.Load() {
			return outcome.Permanentf("negative price")
		}
		return effect(ctx, tx, m)
	}
	cfg := w.perKey(h)
	cfg.Behind = behind
	wantDead := 3
	if behind == consumer.StayParked {
		wantDead = 1
	}
	// Parked in the store too: with StayParked the counts can be reached
	// before the second message behind the head has arrived (RabbitMQ
	// delivers the shard's messages one by one).
	st := w.runUntil(cfg, "the head dead-lettered, P-8 applied, the two behind it parked", func(s consumer.Stats) bool {
		if int(s.DeadLettered) != wantDead || s.Processed != 1 {
			return false
		}
		_, parked := w.storeRows()
		return parked == 2
	})
	if st.Retried != 0 || w.effects() != 1 {
		t.Fatalf("stats %+v, %d effects: want the head dead at its first attempt and only P-8 applied", st, w.effects())
	}
	if b, p := w.storeRows(); b != 1 || p != 2 {
		t.Fatalf("%d blocked keys, %d parked, want 1 and 2", b, p)
	}
	dead := w.b.DeadLetters(t, wantDead)
	if len(dead) != wantDead || id(dead[0]) != id(head) {
		t.Fatalf("%d dead letters (first %s), want %d starting with the head", len(dead), id(dead[0]), wantDead)
	}
	blockedBy := keyorder.BlockedReason(id(head))
	for _, d := range dead[1:] {
		if got, _ := w.reasons.Load(id(d)); got != blockedBy {
			t.Fatalf("letter %s: motiu %q, want %q", id(d), got, blockedBy)
		}
	}
	// The operator fixes the cause and replays the head: the whole sequence
	// is applied, in order.
	poison.Store(false)
	replay := *head
	w.b.Publish(t, &replay)
	st = w.runUntil(w.perKey(h), "the sequence applied", func(s consumer.Stats) bool { return s.Processed+s.Released == 3 })
	if got := w.order(t)["P-9"]; len(got) != 3 || got[0] != 0 || got[1] != 1 || got[2] != 2 {
		t.Fatalf("P-9 effects %v after the replay, want 0 1 2", got)
	}
	if b, p := w.storeRows(); b != 0 || p != 0 || w.effects() != 4 {
		t.Fatalf("%d blocked, %d parked, %d effects after the replay; want 0, 0, 4", b, p, w.effects())
	}
	if behind == consumer.DeadLetterBlocked {
		// Replaying a blocked letter on its own now is a duplicate.
		again := *b1
		w.b.Publish(t, &again)
		st := w.runUntil(w.perKey(h), "the late replay absorbed", func(s consumer.Stats) bool { return s.Duplicates == 1 })
		if st.Processed != 0 || w.effects() != 4 {
			t.Fatalf("stats %+v, %d effects: a replayed blocked letter applied again", st, w.effects())
		}
	}
}

func perKeyDeadLetterBlocked(t *testing.T, w *world) {
	perKeyDeadHead(t, w, consumer.DeadLetterBlocked)
}
func perKeyStayParked(t *testing.T, w *world) { perKeyDeadHead(t, w, consumer.StayParked) }

// blockHead publishes a head whose handler fails until ok is set, waits
// until its key is blocked, and returns it with the running consumer.
func (w *world) failingHead(t *testing.T, key string, ok *atomic.Bool, hooks faults.Consumer[*consumer.Message]) (*transport.Message, *running, consumer.Handler) {
	head := evOf(tipus, key, 0)
	h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Envelope.ID == id(head) && !ok.Load() {
			return outcome.Transient(errors.New("estoc: 503"))
		}
		return effect(ctx, tx, m)
	}
	w.b.Publish(t, head)
	// The head must still be retrying when the test sets ok, however long a
	// loaded machine takes to get there: with the suite's 3 attempts (30 and
	// 60 ms apart) it was dead-lettered first now and then, and no copy came
	// back to reach the crash point. The waits stay capped by BackoffMax.
	cfg := w.perKey(h)
	cfg.MaxAttempts = 1000
	r := w.run(cfg, hooks)
	testkit.Eventually(t, 30*time.Second, "the head blocks its key", func() bool { b, _ := w.storeRows(); return b == 1 })
	return head, r, h
}

// Crash point: inside the transaction that parks a message, before COMMIT.
// Nothing is parked; the redelivery parks it, and it is applied once, after
// the head.
func perKeyCrashParking(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	var ok atomic.Bool
	var inside atomic.Int64
	var behind *transport.Message
	var mu sync.Mutex
	head, r, h := w.failingHead(t, "P-3", &ok, faults.Consumer[*consumer.Message]{
		BeforeTxCommit: func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
			mu.Lock()
			b := behind
			mu.Unlock()
			if b == nil || !isID(ms, b) {
				return nil
			}
			var n int64
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM missatges_aparcats`).Scan(&n); err != nil {
				return err
			}
			inside.Store(n)
			return faults.ErrCrashed
		},
	})
	mu.Lock()
	behind = evOf(cancellada, "P-3", 1)
	mu.Unlock()
	w.b.Publish(t, behind)
	r.crashed(t)
	if _, p := w.storeRows(); inside.Load() != 1 || p != 0 || w.effects() != 0 {
		t.Fatalf("inside the transaction %d parked; after the crash %d parked, %d effects; want 1, 0, 0", inside.Load(), p, w.effects())
	}
	ok.Store(true)
	st := w.runUntil(w.perKey(h), "both applied", func(s consumer.Stats) bool {
		return w.effects() == 2 && s.Processed+s.Duplicates+s.Parked >= 2
	})
	if got := w.order(t)["P-3"]; len(got) != 2 || got[0] != 0 || got[1] != 1 || w.distinctEffects() != 2 {
		t.Fatalf("P-3 effects %v (stats %+v), want the head then the message behind, once each", got, st)
	}
	w.drained(t, head)
}

// drained waits until nothing is blocked or parked and checks the head's
// effect is single.
func (w *world) drained(t *testing.T, head *transport.Message) {
	t.Helper()
	testkit.Eventually(t, 30*time.Second, "the store drained", func() bool { b, p := w.storeRows(); return b == 0 && p == 0 })
	if n := w.count(`SELECT count(*) FROM efectes WHERE id = $1`, id(head)); n != 1 {
		t.Fatalf("the head applied %d times, want 1", n)
	}
}

// Crash point: inside the head's transaction after it released and applied
// the message behind it, before COMMIT. The message stays parked, nothing
// is applied; the head's next copy releases it, once.
func perKeyCrashReleasing(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	var ok atomic.Bool
	var insideParked, insideEffects atomic.Int64
	var headRef atomic.Pointer[transport.Message]
	head, r, h := w.failingHead(t, "P-4", &ok, faults.Consumer[*consumer.Message]{
		BeforeTxCommit: func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
			hd := headRef.Load()
			if hd == nil || !isID(ms, hd) || !ok.Load() {
				return nil
			}
			var p, e int64
			if err := tx.QueryRow(ctx, `SELECT (SELECT count(*) FROM missatges_aparcats), (SELECT count(*) FROM efectes)`).Scan(&p, &e); err != nil {
				return err
			}
			if e == 0 {
				// The head failed in this transaction (its attempt began
				// before ok was set): the one that blocks its key, not the
				// one that releases.
				return nil
			}
			insideParked.Store(p)
			insideEffects.Store(e)
			return faults.ErrCrashed
		},
	})
	headRef.Store(head)
	behind := evOf(cancellada, "P-4", 1)
	w.b.Publish(t, behind)
	testkit.Eventually(t, 30*time.Second, "the message behind parked", func() bool { _, p := w.storeRows(); return p == 1 })
	ok.Store(true)
	r.crashed(t)
	if b, p := w.storeRows(); insideParked.Load() != 0 || insideEffects.Load() != 2 || b != 1 || p != 1 || w.effects() != 0 {
		t.Fatalf("inside: %d parked, %d effects; after the crash: %d blocked, %d parked, %d effects; want 0, 2, 1, 1, 0",
			insideParked.Load(), insideEffects.Load(), b, p, w.effects())
	}
	w.runUntil(w.perKey(h), "both applied", func(consumer.Stats) bool { return w.effects() == 2 })
	if got := w.order(t)["P-4"]; len(got) != 2 || got[0] != 0 || got[1] != 1 || w.distinctEffects() != 2 {
		t.Fatalf("P-4 effects %v, want the head then the message behind, once each", got)
	}
	w.drained(t, head)
}

// Crash point: after the transaction that marks the head committed, before
// the source produced its retry copy. The key stays blocked with no copy in
// flight; the original comes back, is the head, and releases the key.
func perKeyCrashMarking(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	head := evOf(tipus, "P-5", 0)
	var ok atomic.Bool
	h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Envelope.ID == id(head) && !ok.Load() {
			return outcome.Transient(errors.New("estoc: 503"))
		}
		return effect(ctx, tx, m)
	}
	w.b.Publish(t, head)
	r := w.run(w.perKey(h), faults.Consumer[*consumer.Message]{
		AfterCommit: func(ctx context.Context, ms []*consumer.Message) error {
			if isID(ms, head) {
				return faults.ErrCrashed
			}
			return nil
		},
	})
	r.crashed(t)
	if b, _ := w.storeRows(); b != 1 || r.c.Stats().Retried != 0 || w.effects() != 0 {
		t.Fatalf("after the crash: %d blocked, stats %+v, %d effects; want the key blocked, no copy, no effect", b, r.c.Stats(), w.effects())
	}
	w.pending(t, 1, "the original after the crash")
	behind := evOf(cancellada, "P-5", 1)
	w.b.Publish(t, behind)
	ok.Store(true)
	st := w.runUntil(w.perKey(h), "both applied", func(consumer.Stats) bool { return w.effects() == 2 })
	if got := w.order(t)["P-5"]; len(got) != 2 || got[0] != 0 || got[1] != 1 || w.distinctEffects() != 2 || st.Retried != 0 {
		t.Fatalf("P-5 effects %v, stats %+v; want the head then the message behind, once each, no retry", got, st)
	}
	w.drained(t, head)
}

// Crash point: after the release transaction in which a released message
// failed (it becomes the head, kept in the store), before its retry copy
// was produced. The delivery in hand comes back as a duplicate and re-issues
// the copy: nothing is stuck, nothing applied twice.
func perKeyCrashReleasedFailure(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	head, b1, b2 := evOf(tipus, "P-6", 0), evOf(cancellada, "P-6", 1), evOf(tipus, "P-6", 2)
	var ok atomic.Bool
	var b1Fails atomic.Int64
	h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Envelope.ID == id(head) && !ok.Load() {
			return outcome.Transient(errors.New("estoc: 503"))
		}
		if m.Envelope.ID == id(b1) && b1Fails.Load() < 1 {
			b1Fails.Add(1)
			return outcome.Transient(errors.New("passarel·la: 503"))
		}
		return effect(ctx, tx, m)
	}
	w.b.Publish(t, head, b1, b2)
	cfg := w.perKey(h)
	cfg.MaxAttempts = 1000 // the head still retrying when ok is set (see failingHead)
	r := w.run(cfg, faults.Consumer[*consumer.Message]{
		AfterCommit: func(ctx context.Context, ms []*consumer.Message) error {
			if isID(ms, head) && ok.Load() && b1Fails.Load() > 0 {
				return faults.ErrCrashed
			}
			return nil
		},
	})
	testkit.Eventually(t, 30*time.Second, "two parked", func() bool { _, p := w.storeRows(); return p == 2 })
	ok.Store(true)
	r.crashed(t)
	if b, p := w.storeRows(); b != 1 || p != 2 || w.effects() != 1 {
		t.Fatalf("after the crash: %d blocked, %d parked, %d effects; want 1 (the failed released message is the head), 2 (it stays stored), 1 (the head)", b, p, w.effects())
	}
	w.runUntil(w.perKey(h), "all applied", func(consumer.Stats) bool { return w.effects() == 3 })
	if got := w.order(t)["P-6"]; len(got) != 3 || got[0] != 0 || got[1] != 1 || got[2] != 2 || w.distinctEffects() != 3 {
		t.Fatalf("P-6 effects %v, want 0 1 2 once each", got)
	}
	w.drained(t, head)
}

// Many events over many keys, 1% of them failing transiently at their
// first attempt: at the end every key's effects are in event order and
// every event is applied exactly once, with nothing left parked.
func perKeyMany(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	n := w.h.Features.PerKeyEvents
	if n == 0 {
		n = 1000
	}
	keys := max(n/10, 1)
	var msgs []*transport.Message
	failing := map[string]bool{}
	rnd := rand.New(rand.NewPCG(14, 1)) // a fixed 1% of the events, spread over the keys
	fail := map[int]bool{}
	for len(fail) < n/100 {
		fail[rnd.IntN(n)] = true
	}
	for i := range n {
		m := evOf(tipus, fmt.Sprintf("K%04d", i%keys), i/keys)
		if fail[i] {
			failing[id(m)] = true
		}
		msgs = append(msgs, m)
	}
	for i := 0; i < len(msgs); i += 1000 {
		w.b.Publish(t, msgs[i:min(i+1000, len(msgs))]...)
	}
	cfg := w.perKey(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if failing[m.Envelope.ID] && m.Attempt == 1 {
			return outcome.Transient(errors.New("1%: 503"))
		}
		return effect(ctx, tx, m)
	})
	cfg.Backoff = 10 * cfg.Backoff // 300 ms: long enough for later events of a failing key to arrive and park
	st := w.runUntil(cfg, "every event applied", func(consumer.Stats) bool { return w.effects() >= n })
	if w.effects() != n || w.distinctEffects() != n || w.keys() != n {
		t.Fatalf("%d effects (%d distinct), %d keys; want %d each", w.effects(), w.distinctEffects(), w.keys(), n)
	}
	for k, ns := range w.order(t) {
		for i, got := range ns {
			if got != i {
				t.Fatalf("key %s: effects %v, not in event order", k, ns)
			}
		}
	}
	if b, p := w.storeRows(); b != 0 || p != 0 || st.Retried != int64(len(failing)) || st.DeadLettered != 0 {
		t.Fatalf("%d blocked, %d parked, stats %+v; want 0, 0, %d retries, no dead letter", b, p, st, len(failing))
	}
	t.Logf("%d events over %d keys, %d failing once: %d parked, %d released", n, keys, len(failing), st.Parked, st.Released)
}

// A final refusal (Config.FinalFailure) is dead-lettered at its first
// attempt but does not block its key: the cancellation behind it is applied.
func perKeyFinalRefusal(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	errRefused := errors.New("estoc_insuficient")
	creada, cancel := evOf(tipus, "P-7", 0), evOf(cancellada, "P-7", 1)
	w.b.Publish(t, creada, cancel)
	cfg := w.perKey(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Envelope.ID == id(creada) {
			return outcome.Permanent(fmt.Errorf("%w: formatge-curat", errRefused))
		}
		return effect(ctx, tx, m)
	})
	cfg.FinalFailure = func(err error) bool { return errors.Is(err, errRefused) }
	st := w.runUntil(cfg, "the refusal dead-lettered, the cancellation applied", func(s consumer.Stats) bool {
		return s.DeadLettered == 1 && s.Processed == 1
	})
	if b, p := w.storeRows(); b != 0 || p != 0 || st.Parked != 0 || st.Retried != 0 || w.effects() != 1 {
		t.Fatalf("%d blocked, %d parked, stats %+v, %d effects: want the key free and the cancellation applied", b, p, st, w.effects())
	}
}

// A message that HandleBatchOutcomes refuses (transiently, twice, each time
// asking for a retry in 300 ms) blocks its key as a failed Handle does: the
// cancellation published after the first refusal waits behind it.
func perKeyBatchRefusal(t *testing.T, w *world) {
	if !w.h.Features.OrderPerKey {
		t.Skip(w.h.Features.NoOrderPerKey)
	}
	creada, cancel := evOf(tipus, "P-8", 0), evOf(cancellada, "P-8", 1)
	var others []*transport.Message
	for i := range 20 {
		others = append(others, evOf(tipus, fmt.Sprintf("Q-%d", i), 0))
	}
	w.b.Publish(t, append([]*transport.Message{creada}, others...)...)
	var refusals atomic.Int64
	cfg := w.perKey(nil)
	cfg.Handle = nil
	cfg.HandleBatchOutcomes = func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) ([]error, error) {
		out := make([]error, len(ms))
		for i, m := range ms {
			if m.Envelope.ID == id(creada) && refusals.Load() < 2 {
				refusals.Add(1)
				out[i] = outcome.RetryAfter(300*time.Millisecond, errors.New("estoc: ocupat"))
				continue
			}
			if err := effect(ctx, tx, m); err != nil {
				return nil, err
			}
		}
		return out, nil
	}
	r := w.run(cfg, faults.Consumer[*consumer.Message]{})
	testkit.Eventually(t, 30*time.Second, "the first refusal", func() bool { return r.c.Stats().Retried >= 1 })
	w.b.Publish(t, cancel)
	testkit.Eventually(t, 30*time.Second, "every event applied", func() bool { return w.effects() == 22 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if got := w.order(t)["P-8"]; len(got) != 2 || got[0] != 0 || got[1] != 1 || w.distinctEffects() != 22 {
		t.Fatalf("P-8 effects %v, want the creation then the cancellation", got)
	}
	if b, p := w.storeRows(); b != 0 || p != 0 || refusals.Load() != 2 || r.c.Stats().Parked < 1 {
		t.Fatalf("%d blocked, %d parked, %d refusals, stats %+v: want 0, 0, 2, the cancellation parked", b, p, refusals.Load(), r.c.Stats())
	}
}
