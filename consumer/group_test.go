package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
)

// Competing consumers. Three members of one group on 6 partitions share 10,000
// keyed events (200 keys × 50). About 1% fail transiently once and go through
// .retry. Crash point: member 2 is killed right after a DB commit and before
// its offsets are committed, once the other two are processing too; its
// client leaves without committing anything more. Nothing is lost, no effect
// is applied twice, and every key none of whose events went to retry saw its
// effects in publication order.
func TestCompetingConsumersSurviveAKilledMember(t *testing.T) {
	t.Parallel()
	const keys, perKey = 200, 50
	b := setup(t)
	var recs []*kgo.Record
	for n := range perKey {
		for k := range keys {
			recs = append(recs, seqEvent(fmt.Sprintf("K-%03d", k), n).record())
		}
	}
	b.publish(recs...)

	var retried sync.Map // keys with an event that went to retry
	h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		var d comanda
		if err := m.Envelope.DataAs(&d); err != nil {
			return err
		}
		if m.Attempt == 1 && (d.N*7+len(m.Key)+int(m.Key[len(m.Key)-1]))%100 == 3 {
			retried.Store(string(m.Key), true)
			return outcome.Transient(errors.New("mapes: 503"))
		}
		return effect(ctx, tx, m)
	}

	var members [3]atomic.Pointer[consumer.Consumer]
	var commits atomic.Int64
	cfgFor := func(i int) testConfig {
		cfg := b.config(h)
		cfg.Backoff = 20 * time.Millisecond
		cfg.Concurrency = 2
		cfg.Logger = b.log.With("membre", i)
		if i == 1 {
			cfg.Hooks.AfterCommit = func(context.Context, []*consumer.Message) error {
				others := members[0].Load() != nil && members[2].Load() != nil &&
					members[0].Load().Stats().Processed > 0 && members[2].Load().Stats().Processed > 0
				if commits.Add(1) >= 5 && others {
					return faults.ErrCrashed
				}
				return nil
			}
		}
		return cfg
	}
	killed := b.run(cfgFor(1)) // first, so it surely owns partitions when the others arrive
	members[1].Store(killed.c)
	testkit.Eventually(t, time.Minute, "member 2 to start processing", func() bool { return killed.c.Stats().Processed > 0 })
	m1, m3 := b.run(cfgFor(0)), b.run(cfgFor(2))
	members[0].Store(m1.c)
	members[2].Store(m3.c)

	if err := killed.wait(t); !errors.Is(err, faults.ErrCrashed) {
		t.Fatalf("member 2: %v, want ErrCrashed", err)
	}
	testkit.Eventually(t, time.Minute, "every event's effect", func() bool { return b.effects() >= keys*perKey })
	for _, r := range []*running{m1, m3} {
		if err := r.stop(); err != nil {
			t.Fatal(err)
		}
	}

	if n, distinct := b.effects(), b.count(`SELECT count(DISTINCT (clau, n)) FROM efectes`); n != keys*perKey || distinct != n {
		t.Fatalf("effects %d (distinct %d), want %d: lost or doubled", n, distinct, keys*perKey)
	}
	s1, s2, s3 := m1.c.Stats(), killed.c.Stats(), m3.c.Stats()
	t.Logf("member 1 %+v\nmember 2 (killed) %+v\nmember 3 %+v", s1, s2, s3)
	if s2.Processed == 0 || s1.Processed == 0 || s3.Processed == 0 {
		t.Fatal("premise: every member processed events")
	}
	if s1.Duplicates+s3.Duplicates == 0 {
		t.Fatal("the killed member's last batch was not redelivered to the survivors")
	}
	if s1.Retried+s2.Retried+s3.Retried == 0 {
		t.Fatal("premise: some events went to retry")
	}

	rows, err := b.s.Pool.Query(context.Background(), `SELECT clau, n FROM efectes ORDER BY clau, seq`)
	if err != nil {
		t.Fatal(err)
	}
	next := map[string]int{}
	checked := 0
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			t.Fatal(err)
		}
		if _, skip := retried.Load(k); skip {
			continue
		}
		if n != next[k] {
			t.Fatalf("key %s: effect %d came where %d was due", k, n, next[k])
		}
		next[k]++
		checked++
	}
	if checked < keys*perKey/2 {
		t.Fatalf("premise: only %d effects had their order checked", checked)
	}
}
