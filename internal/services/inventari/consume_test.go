package inventari_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

const ordersTopic = "comandes.esdeveniments"

// world is a migrated km0_inventari database of its own (so that
// pg_stat_database counts only this test's deadlocks), the service, and an
// embedded broker with the orders topic (6 partitions).
type world struct {
	t      testing.TB
	url    string
	dbName string
	pool   *pgxpool.Pool
	s      *inventari.Service
	b      *kafkaembed.Broker
	pub    *kgo.Client
}

func newWorld(t testing.TB, conns int32) *world {
	t.Helper()
	u := pgtest.NewDatabase(t)
	pc, err := pgx.ParseConfig(u)
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.NewPool(t, u, conns)
	if _, err := migrate.Up(context.Background(), pool, migrate.Names{}, migrate.Outbox, migrate.Inbox, inventari.Migrations); err != nil {
		t.Fatal(err)
	}
	s, err := inventari.New(inventari.Config{Pool: pool, Outbox: svctest.Outbox(t)})
	if err != nil {
		t.Fatal(err)
	}
	b := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{ordersTopic}})
	return &world{t: t, url: u, dbName: pc.Database, pool: pool, s: s, b: b, pub: kafkatest.Client(t, b)}
}

// config is the consumer of comanda.creada as services/system wires it.
func (w *world) config() consumer.Config {
	return consumer.Config{
		Source: w.source(),
		Name:   inventari.ConsumerDecrement, Pool: w.pool, Types: []string{inventari.TypeOrderCreated},
		Handle: w.s.HandleOrderCreated, HandleBatchOutcomes: w.s.HandleOrdersCreated,
		Backoff: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

// source is a new Kafka source of the consumer (a source runs once).
func (w *world) source() *kafka.Source {
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: w.b.Addrs(), Group: inventari.ConsumerDecrement, Topics: []string{ordersTopic},
		KgoOpts: []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(100 * time.Millisecond)}})
	if err != nil {
		w.t.Fatal(err)
	}
	return src
}

// orderRecord is comanda.creada id with lines, keyed by key.
func orderRecord(t testing.TB, key, id string, lines ...inventari.Line) (*kgo.Record, string) {
	t.Helper()
	ls := make([]map[string]any, len(lines))
	for i, l := range lines { // comanda.creada v2 (schemas/), as comandes writes it
		ls[i] = map[string]any{"producte": l.Product, "quantitat": l.Quantity, "preu_centims": 250}
	}
	dades, _ := json.Marshal(map[string]any{"id": id, "client": "anna", "mercat": "girona", "linies": ls})
	env := &envelope.Envelope{ID: uuid.NewString(), Type: inventari.TypeOrderCreated, Version: 2, TimeMS: 1789000000000, Origin: "comandes", Data: dades}
	v, err := env.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return &kgo.Record{Topic: ordersTopic, Key: []byte(key), Value: v, Headers: []kgo.RecordHeader{
		{Key: contract.HeaderType, Value: []byte(env.Type)}, {Key: contract.HeaderEventID, Value: []byte(env.ID)}}}, env.ID
}

func (w *world) publish(recs ...*kgo.Record) {
	w.t.Helper()
	if err := w.pub.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		w.t.Fatal(err)
	}
}

// runUntil runs a consumer until done holds for its stats, stops it and
// returns its final stats.
func (w *world) runUntil(cfg consumer.Config, what string, done func(consumer.Stats) bool) consumer.Stats {
	w.t.Helper()
	cfg.Source = w.source()
	c, err := consumer.New(cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	r := testkit.Start(w.t, "consumer", c.Run)
	testkit.Eventuallyf(w.t, 90*time.Second, what, func() (bool, string) {
		return done(c.Stats()), fmt.Sprintf("stats %+v", c.Stats())
	})
	if err := r.Stop(); err != nil {
		w.t.Fatal(err)
	}
	return c.Stats()
}

// deadlocks returns pg_stat_database.deadlocks of the world's database; with
// settled, once every other backend of it has exited (a backend flushes its
// counts when it exits): close the world's pool first.
func (w *world) deadlocks(settled bool) int64 {
	w.t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, w.url)
	if err != nil {
		w.t.Fatal(err)
	}
	defer conn.Close(ctx)
	if settled {
		testkit.Eventuallyf(w.t, 30*time.Second, "every other backend of "+w.dbName+" to exit", func() (bool, string) {
			var others int
			if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&others); err != nil {
				w.t.Fatal(err)
			}
			return others == 0, fmt.Sprintf("%d still connected", others)
		})
	}
	if _, err := conn.Exec(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
		w.t.Fatal(err)
	}
	var n int64
	if err := conn.QueryRow(ctx, `SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`).Scan(&n); err != nil {
		w.t.Fatal(err)
	}
	return n
}

// stockEvents returns the estoc.actualitzat of the outbox by product, in the
// order the relay publishes them (creat_en, id).
func stockEvents(t *testing.T, pool *pgxpool.Pool) map[string][]inventari.StockUpdated {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT agregat_id, carrega FROM outbox WHERE tipus = 'estoc.actualitzat' ORDER BY creat_en, id`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]inventari.StockUpdated{}
	var (
		p    string
		body []byte
	)
	if _, err := pgx.ForEachRow(rows, []any{&p, &body}, func() error {
		var e inventari.StockUpdated
		if err := json.Unmarshal(body, &e); err != nil {
			return err
		}
		if e.Product != p {
			return fmt.Errorf("agregat_id %s for %+v", p, e)
		}
		out[p] = append(out[p], e)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// Proof of "hot rows neither deadlock nor serialise the consumer": 2,000
// orders over the contract's five products, keyed by order id over 6
// partitions, consumed with Concurrency 4 and batches of 100, with one
// product (formatge-curat) running out. Ends: stock = initial + restock −
// what the applied orders took, exactly; PostgreSQL counted 0 deadlocks in
// the database (pg_stat_database) and the consumer reran no conflict; every
// refused order is in the DLQ once with estoc_insuficient and its key
// absent; every other order applied once (one estoc.actualitzat per
// product, key present). The outbox's estoc.actualitzat of each product
// chain (abans = the previous despres, from the initial stock to the final one)
// and, per source partition, follow offset order.
func TestHotRowsConcurrentBatchesNeverDeadlockAndStockIsExact(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 4)
	ctx := context.Background()
	// deadlock_timeout of this test's database only: a deadlock costs 50 ms
	// instead of 1 s, so the old lock order fails this test quickly.
	if _, err := w.pool.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{w.dbName}.Sanitize()+" SET deadlock_timeout = '50ms'"); err != nil {
		t.Fatal(err)
	}
	w.pool.Reset() // new connections pick the setting up
	restock := map[string]int{"tomaquet-rosa": 10_000, "carbasso": 10_000, "formatge-fresc": 10_000, "vi-crianca": 10_000, "formatge-curat": 40}
	for p, n := range restock {
		if err := w.s.Restock(ctx, p, n); err != nil {
			t.Fatal(err)
		}
	}
	products := []string{"tomaquet-rosa", "carbasso", "formatge-curat", "formatge-fresc", "vi-crianca"}
	const n = 2000
	rng := rand.New(rand.NewPCG(11, 1))
	type sent struct {
		id        string
		lines     map[string]int
		partition int32
		offset    int64
	}
	byEvent := map[string]*sent{}
	byOrder := map[string]*sent{}
	recs := make([]*kgo.Record, 0, n)
	for i := range n {
		id := fmt.Sprintf("P-2026-%06d", i)
		var lines []inventari.Line
		m := map[string]int{}
		for range 1 + rng.IntN(2) {
			l := inventari.Line{Product: products[rng.IntN(len(products))], Quantity: 1 + rng.IntN(3)}
			lines = append(lines, l)
			m[l.Product] += l.Quantity
		}
		r, ev := orderRecord(t, id, id, lines...)
		recs = append(recs, r)
		s := &sent{id: id, lines: m}
		byEvent[ev], byOrder[id] = s, s
	}
	res := w.pub.ProduceSync(ctx, recs...)
	if err := res.FirstErr(); err != nil {
		t.Fatal(err)
	}
	parts := map[int32]bool{}
	for _, r := range res {
		s := byEvent[header(r.Record, contract.HeaderEventID)]
		s.partition, s.offset = r.Record.Partition, r.Record.Offset
		parts[s.partition] = true
	}
	if len(parts) < 4 {
		t.Fatalf("orders on %d partitions, want several", len(parts))
	}
	before := w.deadlocks(false)

	cfg := w.config()
	cfg.Concurrency = 4
	st := w.runUntil(cfg, "every order applied or dead-lettered", func(s consumer.Stats) bool { return s.Processed+s.DeadLettered == n })

	events := stockEvents(t, w.pool)
	applied := map[string]bool{}
	rows, err := w.pool.Query(ctx, `SELECT id_missatge FROM missatges_processats WHERE consumidor = $1`, inventari.ConsumerDecrement)
	if err != nil {
		t.Fatal(err)
	}
	var key string
	if _, err := pgx.ForEachRow(rows, []any{&key}, func() error { applied[key] = true; return nil }); err != nil {
		t.Fatal(err)
	}
	stock, err := w.s.Stock(ctx)
	if err != nil {
		t.Fatal(err)
	}
	w.pool.Close()
	deadlocks := w.deadlocks(true) - before

	dlq := kafkatest.ReadAll(t, w.b, ordersTopic+contract.DLQSuffix, int(st.DeadLettered), 30*time.Second)
	refused := map[string]int{}
	for _, r := range dlq {
		ev, motiu := header(r, contract.HeaderEventID), header(r, contract.HeaderReason)
		refused[ev]++
		s := byEvent[ev]
		if s == nil || !strings.Contains(motiu, "estoc_insuficient: formatge-curat") || header(r, contract.HeaderAttempts) != "1" {
			t.Errorf("dead letter %s: motiu %q intents %s", ev, motiu, header(r, contract.HeaderAttempts))
			continue
		}
		if applied[ev] {
			t.Errorf("refused order %s has its key recorded", s.id)
		}
		if refused[ev] > 1 {
			t.Errorf("order %s dead-lettered %d times", s.id, refused[ev])
		}
	}
	if len(applied)+len(refused) != n || int64(len(dlq)) != st.DeadLettered {
		t.Errorf("%d applied + %d refused, want %d in all (dlq %d, stats %+v)", len(applied), len(refused), n, len(dlq), st)
	}
	want := map[string]int{}
	perOrder := map[string]int{} // events of each order
	for p := range restock {
		want[p] = inventari.InitialStock[p] + restock[p]
	}
	for ev, s := range byEvent {
		if applied[ev] {
			for p, q := range s.lines {
				want[p] -= q
			}
		}
	}
	for p := range want {
		if stock[p] != want[p] {
			t.Errorf("stock of %s = %d, want %d", p, stock[p], want[p])
		}
	}
	if stock["formatge-curat"] >= 3 || len(refused) == 0 {
		t.Errorf("formatge-curat did not run out: %d left, %d refused", stock["formatge-curat"], len(refused))
	}
	for p, es := range events {
		prev := inventari.InitialStock[p]
		lastOffset := map[int32]int64{}
		for i, e := range es {
			if e.Before != prev || (e.Reason == inventari.ReasonOrder) != (e.After < e.Before) {
				t.Fatalf("%s event %d: abans %d despres %d after despres %d", p, i, e.Before, e.After, prev)
			}
			prev = e.After
			if e.Reason != inventari.ReasonOrder {
				continue
			}
			s := byOrder[e.OrderID]
			perOrder[e.OrderID]++
			if e.Before-e.After != s.lines[p] {
				t.Fatalf("%s event of %s took %d, the order asks %d", p, e.OrderID, e.Before-e.After, s.lines[p])
			}
			if last, ok := lastOffset[s.partition]; ok && s.offset <= last {
				t.Fatalf("%s: order at offset %d of partition %d published after offset %d", p, s.offset, s.partition, last)
			}
			lastOffset[s.partition] = s.offset
		}
		if prev != stock[p] {
			t.Errorf("%s events end at %d, stock is %d", p, prev, stock[p])
		}
	}
	for ev, s := range byEvent {
		if wantN := len(s.lines); applied[ev] && perOrder[s.id] != wantN {
			t.Errorf("applied order %s has %d events, want %d", s.id, perOrder[s.id], wantN)
		} else if !applied[ev] && perOrder[s.id] != 0 {
			t.Errorf("refused order %s has %d events", s.id, perOrder[s.id])
		}
	}
	if deadlocks != 0 || st.Conflicts != 0 {
		t.Errorf("PostgreSQL detected %d deadlocks; the consumer reran %d conflicts", deadlocks, st.Conflicts)
	}
	t.Logf("%d applied, %d refused, %d deadlocks, stats %+v", len(applied), len(refused), deadlocks, st)
}

func header(r *kgo.Record, k string) string {
	for _, h := range r.Headers {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}

// Proof of "a refused order does not send its batch to the slow path": one
// transaction holds a duplicate (an order already applied), an order that
// asks 6 of the 5 formatge-curat and a good order. The good order commits,
// the duplicate changes nothing, the short one is dead-lettered at its first
// attempt with estoc_insuficient and without its key; the batch handler ran
// once and the one-message Handle never.
func TestBatchWithDuplicateAndShortOrderCommitsTheGoodOneAndDeadLettersTheShortOne(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 4)
	var batches, batchMsgs, singles atomic.Int64
	cfg := w.config()
	cfg.Handle = func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		singles.Add(1)
		return w.s.HandleOrderCreated(ctx, tx, m)
	}
	cfg.HandleBatchOutcomes = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) ([]error, error) {
		batches.Add(1)
		batchMsgs.Add(int64(len(msgs)))
		return w.s.HandleOrdersCreated(ctx, tx, msgs)
	}
	a, _ := orderRecord(t, "k", "P-2026-000001", inventari.Line{Product: "tomaquet-rosa", Quantity: 1})
	w.publish(a)
	w.runUntil(cfg, "the first order", func(s consumer.Stats) bool { return s.Processed == 1 })
	batches.Store(0)
	batchMsgs.Store(0)

	short, shortID := orderRecord(t, "k", "P-2026-000002", inventari.Line{Product: "vi-crianca", Quantity: 1}, inventari.Line{Product: "formatge-curat", Quantity: 6})
	good, goodID := orderRecord(t, "k", "P-2026-000003", inventari.Line{Product: "formatge-curat", Quantity: 2}, inventari.Line{Product: "vi-crianca", Quantity: 4})
	dup := &kgo.Record{Topic: a.Topic, Key: a.Key, Value: a.Value, Headers: a.Headers}
	w.publish(dup, short, good) // one produce: one fetch, one batch
	st := w.runUntil(cfg, "the mixed batch", func(s consumer.Stats) bool { return s.Processed+s.Duplicates+s.DeadLettered == 3 })
	if st.Processed != 1 || st.Duplicates != 1 || st.DeadLettered != 1 || st.Retried != 0 {
		t.Fatalf("stats %+v, want 1 processed, 1 duplicate, 1 dead-lettered", st)
	}
	if batches.Load() != 1 || batchMsgs.Load() != 2 || singles.Load() != 0 {
		t.Fatalf("%d batch calls with %d messages and %d single calls, want 1 with 2 and 0", batches.Load(), batchMsgs.Load(), singles.Load())
	}
	dl := kafkatest.ReadAll(t, w.b, ordersTopic+contract.DLQSuffix, 1, 30*time.Second)
	if len(dl) != 1 || header(dl[0], contract.HeaderEventID) != shortID || header(dl[0], contract.HeaderAttempts) != "1" ||
		!strings.HasPrefix(header(dl[0], contract.HeaderReason), "permanent: estoc_insuficient: formatge-curat (5 left, 6 asked)") {
		t.Fatalf("dead letters %d: %s intents %s motiu %q", len(dl), header(dl[0], contract.HeaderEventID), header(dl[0], contract.HeaderAttempts), header(dl[0], contract.HeaderReason))
	}
	for id, want := range map[string]int{shortID: 0, goodID: 1} {
		if n := svctest.Count(t, w.pool, `SELECT count(*) FROM missatges_processats WHERE id_missatge = $1`, id); n != want {
			t.Errorf("key %s recorded %d times, want %d", id, n, want)
		}
	}
	if f, v, tom := units(t, w.pool, "formatge-curat"), units(t, w.pool, "vi-crianca"), units(t, w.pool, "tomaquet-rosa"); f != 3 || v != 196 || tom != 119 {
		t.Fatalf("stock formatge-curat %d vi-crianca %d tomaquet-rosa %d, want 3 196 119", f, v, tom)
	}
	ev := stockEvents(t, w.pool)
	want := map[string][]inventari.StockUpdated{
		"tomaquet-rosa":  {{Product: "tomaquet-rosa", Before: 120, After: 119, Reason: "comanda", OrderID: "P-2026-000001"}},
		"formatge-curat": {{Product: "formatge-curat", Before: 5, After: 3, Reason: "comanda", OrderID: "P-2026-000003"}},
		"vi-crianca":     {{Product: "vi-crianca", Before: 200, After: 196, Reason: "comanda", OrderID: "P-2026-000003"}},
	}
	if len(ev) != len(want) {
		t.Fatalf("events %+v, want %+v", ev, want)
	}
	for p, es := range want {
		if len(ev[p]) != 1 || ev[p][0] != es[0] {
			t.Fatalf("events of %s %+v, want %+v", p, ev[p], es)
		}
	}
}

// Several orders of one batch on the same product: each is checked against
// the stock the orders before it left, in message order, and the events
// chain in that order.
func TestOrdersOfOneBatchTakeStockInMessageOrder(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	var msgs []*consumer.Message
	for i, q := range []int{2, 4, 1, 3, 2} { // formatge-curat 5: 2 → 3 left, 4 refused, 1 → 2 left, 3 refused, 2 → 0
		msgs = append(msgs, svctest.Message(t, ordersTopic, inventari.TypeOrderCreated, 2,
			order(fmt.Sprintf("P-2026-%06d", i), inventari.Line{Product: "formatge-curat", Quantity: q})))
	}
	msgs = append(msgs, svctest.Message(t, ordersTopic, inventari.TypeOrderCreated, 2, map[string]any{"id": "x"}))
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	outcomes, err := s.HandleOrdersCreated(ctx, tx, msgs)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for i, want := range []error{nil, inventari.ErrInsufficient, nil, inventari.ErrInsufficient, nil} {
		if (want == nil) != (outcomes[i] == nil) || (want != nil && !errors.Is(outcomes[i], want)) {
			t.Errorf("order %d: %v, want %v", i, outcomes[i], want)
		}
	}
	if err := outcomes[5]; err == nil || !strings.Contains(err.Error(), "esquema") {
		t.Errorf("order without lines: %v", err)
	}
	got := stockEvents(t, pool)["formatge-curat"]
	want := []inventari.StockUpdated{
		{Product: "formatge-curat", Before: 5, After: 3, Reason: "comanda", OrderID: "P-2026-000000"},
		{Product: "formatge-curat", Before: 3, After: 2, Reason: "comanda", OrderID: "P-2026-000002"},
		{Product: "formatge-curat", Before: 2, After: 0, Reason: "comanda", OrderID: "P-2026-000004"},
	}
	if len(got) != len(want) {
		t.Fatalf("events %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("event %d %+v, want %+v", i, got[i], want[i])
		}
	}
	if u := units(t, pool, "formatge-curat"); u != 0 {
		t.Fatalf("formatge-curat %d, want 0", u)
	}
}
