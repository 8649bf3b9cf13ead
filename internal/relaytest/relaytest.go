// Package relaytest holds what the tests of both relays (relay, relay/cdc)
// check order and completeness with: events that carry their aggregate's
// commit order, concurrent writers that produce them, and the checks of
// what reached the topic.
package relaytest

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// Read returns topic's records on b (in partition order), waiting up to
// 20 s for at least n.
func Read(t testing.TB, b *kafkaembed.Broker, topic string, n int) []*kgo.Record {
	t.Helper()
	recs := kafkatest.ReadAll(t, b, topic, n, 20*time.Second)
	if len(recs) < n {
		t.Fatalf("topic has %d records, want at least %d", len(recs), n)
	}
	return recs
}

// SeqPayload is the payload of ordered events: Seq is the aggregate's commit
// order, taken under a row lock of the writer's transaction.
type SeqPayload struct {
	Seq int `json:"seq"`
}

// FirstSeqs decodes the records and returns, per key, the seq of each event
// id at its first occurrence, in topic order; and the number of records per
// id.
func FirstSeqs(t testing.TB, recs []*kgo.Record) (map[string][]int, map[string]int) {
	t.Helper()
	perKey := map[string][]int{}
	copies := map[string]int{}
	for _, r := range recs {
		env, err := envelope.Decode(r.Value)
		if err != nil {
			t.Fatalf("record at %d/%d: %v", r.Partition, r.Offset, err)
		}
		copies[env.ID]++
		if copies[env.ID] > 1 {
			continue
		}
		var p SeqPayload
		if err := json.Unmarshal(env.Data, &p); err != nil {
			t.Fatal(err)
		}
		perKey[string(r.Key)] = append(perKey[string(r.Key)], p.Seq)
	}
	return perKey, copies
}

// CheckCommitOrder asserts that every aggregate's events arrived, by first
// occurrence, as 1, 2, ..., want[agg]: nothing missing, commit order kept.
func CheckCommitOrder(t testing.TB, perKey map[string][]int, want map[string]int) {
	t.Helper()
	bad := 0
	for agg, n := range want {
		got := perKey[agg]
		ok := len(got) == n
		for i := 0; ok && i < n; i++ {
			ok = got[i] == i+1
		}
		if !ok {
			bad++
			if bad <= 5 {
				t.Errorf("aggregate %s: got seqs %v, want 1..%d in order", agg, ClipInts(got), n)
			}
		}
	}
	if len(perKey) != len(want) {
		t.Errorf("%d keys on the topic, want %d", len(perKey), len(want))
	}
	if bad > 0 {
		t.Fatalf("%d of %d aggregates out of commit order or incomplete", bad, len(want))
	}
}

// ClipInts prints at most the first 20 of s.
func ClipInts(s []int) string {
	if len(s) > 20 {
		return fmt.Sprint(s[:20]) + "…"
	}
	return fmt.Sprint(s)
}

// Total is the sum of m's values.
func Total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// Writers runs goroutines that each commit transactions; each transaction
// bumps the counters of 2 random aggregates (taking their row locks, so the
// counter value is the aggregate's commit order) and enqueues one event per
// aggregate carrying that value: the relays' concurrent-writers load.
type Writers struct {
	pool *pgxpool.Pool
	ob   *outbox.Outbox
	aggs []string
}

// NewWriters creates the counters table (comptadors) of aggs aggregates in
// pool's schema.
func NewWriters(t testing.TB, pool *pgxpool.Pool, ob *outbox.Outbox, aggs int) *Writers {
	t.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE TABLE comptadors (agregat_id TEXT PRIMARY KEY, n INT NOT NULL DEFAULT 0)"); err != nil {
		t.Fatal(err)
	}
	w := &Writers{pool: pool, ob: ob}
	for i := range aggs {
		w.aggs = append(w.aggs, fmt.Sprintf("P-%05d", i))
	}
	if _, err := pool.Exec(ctx, "INSERT INTO comptadors (agregat_id) SELECT unnest($1::text[])", w.aggs); err != nil {
		t.Fatal(err)
	}
	return w
}

// Run commits n×txs transactions with n concurrent writers and returns the
// first error.
func (w *Writers) Run(ctx context.Context, n, txs int, seed uint64) error {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for g := range n {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(seed+uint64(g)*7919, seed^0x9e3779b97f4a7c15))
			for range txs {
				a, b := w.aggs[rnd.IntN(len(w.aggs))], w.aggs[rnd.IntN(len(w.aggs))]
				if b < a {
					a, b = b, a
				}
				if err := w.One(ctx, a, b); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// One commits one transaction bumping aggs (each once) and enqueuing their
// events.
func (w *Writers) One(ctx context.Context, aggs ...string) error {
	return pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		var events []*outbox.Event
		seen := map[string]bool{}
		for _, a := range aggs {
			if seen[a] {
				continue
			}
			seen[a] = true
			var n int
			if err := tx.QueryRow(ctx, "UPDATE comptadors SET n = n + 1 WHERE agregat_id = $1 RETURNING n", a).Scan(&n); err != nil {
				return err
			}
			events = append(events, &outbox.Event{Aggregate: "comanda", AggregateID: a, Type: "comanda.creada",
				Payload: SeqPayload{Seq: n}})
		}
		return w.ob.EnqueueBatch(ctx, tx, events)
	})
}

// Counts returns each aggregate's final counter (events written).
func (w *Writers) Counts(t testing.TB) map[string]int {
	t.Helper()
	rows, err := w.pool.Query(context.Background(), "SELECT agregat_id, n FROM comptadors WHERE n > 0")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for rows.Next() {
		var a string
		var n int
		if err := rows.Scan(&a, &n); err != nil {
			t.Fatal(err)
		}
		out[a] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}
