package dlq_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// groupConsumer is one consumer group of comandes.esdeveniments that fails
// every event permanently while failing is set, and counts per event the
// times its handler succeeded.
type groupConsumer struct {
	group   string
	c       *consumer.Consumer
	failing atomic.Bool
	mu      sync.Mutex
	applied map[string]int
}

func (g *groupConsumer) count(id string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.applied[id]
}

// runGroup starts a Kafka consumer of group on comandes (inbox in b's schema).
func (b *bundle) runGroup(t *testing.T, group string, failing bool) *groupConsumer {
	t.Helper()
	g := &groupConsumer{group: group, applied: map[string]int{}}
	g.failing.Store(failing)
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: b.broker.Addrs(), Group: group, Topics: []string{comandes},
		KgoOpts: []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{Source: src, Pool: b.schema.Pool, Names: b.schema.Names(), Name: group + ".efecte",
		Inbox: inbox.New(inbox.Config{Names: b.schema.Names()}), Backoff: 20 * time.Millisecond,
		Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if g.failing.Load() {
				return outcome.Permanentf("prova: %s refuses the event", group)
			}
			// Counted once the transaction commits: the inbox key is in it.
			g.mu.Lock()
			g.applied[m.Envelope.ID]++
			g.mu.Unlock()
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	g.c = c
	return g
}

// publishEvents publishes n comanda.creada events to comandes.
func (b *bundle) publishEvents(t *testing.T, n int) []string {
	t.Helper()
	var ids []string
	var msgs []*transport.Message
	for i := 0; i < n; i++ {
		id := uuid.NewString()
		ids = append(ids, id)
		msgs = append(msgs, &transport.Message{Topic: comandes, Key: []byte("P-" + id[:8]), Value: event(t, id, time.Now()),
			Headers: []transport.Header{{Key: "tipus", Value: "comanda.creada"}, {Key: "id_esdeveniment", Value: id}}})
	}
	if err := kafka.NewPublisher(b.client).Publish(b.ctx, msgs); err != nil {
		t.Fatal(err)
	}
	return ids
}

// A replay reaches only the consumer group that dead-lettered the letter.
// Three events fail in comandes.pagament only; analitica (counting, no
// effect to deduplicate against) applies each once. Replaying comandes'
// three letters delivers each to comandes once and to analitica never: its
// count stays 3 (it was 6 when a replay went to the topic itself), its
// source skips the three copies addressed to another group (Foreign 3), and
// no new dead letter appears.
func TestReplayReachesOnlyTheConsumerThatFailed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pay := b.runGroup(t, "comandes.pagament", true)
	an := b.runGroup(t, "analitica", false)
	ids := b.publishEvents(t, 3)
	testkit.Eventually(t, 30*time.Second, "3 dead letters of comandes.pagament and 3 counts of analitica", func() bool {
		return pay.c.Stats().DeadLettered == 3 && an.c.Stats().Processed == 3
	})

	testkit.Eventually(t, 10*time.Second, "3 letters indexed", func() bool { b.sync(t); return b.rows(t, dlq.StatePending) == 3 })
	pay.failing.Store(false)

	rep := b.replay(t, dlq.Filter{Group: "comandes.pagament"}, dlq.ReplayOptions{})
	if rep.Done != 3 || rep.Refused != 0 {
		t.Fatalf("replay: %+v", rep)
	}
	testkit.Eventually(t, 30*time.Second, "comandes.pagament applying the 3 replays and analitica skipping them", func() bool {
		sa := an.c.Stats()
		return pay.c.Stats().Processed == 3 && sa.Foreign+sa.Duplicates+sa.Processed >= 6
	})

	for _, id := range ids {
		if p, a := pay.count(id), an.count(id); p != 1 || a != 1 {
			t.Fatalf("event %s: comandes.pagament applied it %d time(s), analitica %d; want 1 and 1", id, p, a)
		}
	}
	if st := an.c.Stats(); st.Processed != 3 || st.Duplicates != 0 || st.Foreign != 3 {
		t.Fatalf("analitica: processed %d, duplicates %d, skipped as another group's %d; want 3, 0 and 3 (a replay is not for it)",
			st.Processed, st.Duplicates, st.Foreign)
	}
	if res := b.sync(t); len(res.New) != 0 {
		t.Fatalf("%d new dead letter(s) after the replay, want 0", len(res.New))
	}
}

// Three events, each failed in two consumers: six letters. Replaying all six
// at once delivers each event once to each consumer and makes no new dead
// letter (it made twelve when each replay went to every group).
func TestReplayOfTwoConsumersLettersDeliversOnceToEach(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.runGroup(t, "comandes.pagament", true)
	c := b.runGroup(t, "inventari.descompte", true)
	ids := b.publishEvents(t, 3)
	testkit.Eventually(t, 30*time.Second, "3 dead letters in each consumer", func() bool {
		return a.c.Stats().DeadLettered == 3 && c.c.Stats().DeadLettered == 3
	})

	testkit.Eventually(t, 10*time.Second, "6 letters indexed", func() bool { b.sync(t); return b.rows(t, dlq.StatePending) == 6 })
	a.failing.Store(false)
	c.failing.Store(false)

	rep := b.replay(t, dlq.Filter{}, dlq.ReplayOptions{})
	if rep.Done != 6 || rep.Refused != 0 {
		t.Fatalf("replay: %+v", rep)
	}
	testkit.Eventually(t, 30*time.Second, "each consumer applying its 3 replays and skipping the other's 3", func() bool {
		sa, sc := a.c.Stats(), c.c.Stats()
		return sa.Processed+sa.Duplicates+sa.Foreign >= 6 && sc.Processed+sc.Duplicates+sc.Foreign >= 6
	})

	if sa, sc := a.c.Stats(), c.c.Stats(); sa.Processed != 3 || sc.Processed != 3 || sa.Foreign != 3 || sc.Foreign != 3 ||
		sa.Duplicates != 0 || sc.Duplicates != 0 {
		t.Fatalf("after the replay: processed %d and %d, duplicates %d and %d, skipped %d and %d; want 3, 0 and 3 in each",
			sa.Processed, sc.Processed, sa.Duplicates, sc.Duplicates, sa.Foreign, sc.Foreign)
	}
	for _, id := range ids {
		if x, y := a.count(id), c.count(id); x != 1 || y != 1 {
			t.Fatalf("event %s applied %d and %d time(s); want once in each consumer", id, x, y)
		}
	}
	if sa, sc := a.c.Stats(), c.c.Stats(); sa.DeadLettered != 3 || sc.DeadLettered != 3 {
		t.Fatalf("dead-lettered %d and %d in all; want 3 and 3 (none after the replay)", sa.DeadLettered, sc.DeadLettered)
	}
	if res := b.sync(t); len(res.New) != 0 {
		t.Fatalf("%d new dead letter(s) after the replay, want 0", len(res.New))
	}
}

// After a SIGKILL both retry copies of one message can reach the restarted
// consumer: two letters of one event and consumer. A folded listing shows
// one letter for them, counting 2 copies; the counts still count 3 letters.
func TestFoldedListingShowsOneLetterPerEventAndConsumer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, dup := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: estoc insuficient"})
	b.produceDead(t, dead{topic: comandes, key: "P-1", eventID: dup, reason: "permanent: estoc insuficient"})
	_, other := b.produceDead(t, dead{topic: comandes, key: "P-2", reason: "permanent: estoc insuficient"})
	b.sync(t)
	ls := b.list(t, dlq.Filter{Fold: true})
	copies := map[string]int{}
	for _, l := range ls.Letters {
		copies[l.EventID] = l.Copies
	}
	if len(ls.Letters) != 2 || copies[dup] != 2 || copies[other] != 1 || ls.Groups[0].Count != 3 {
		t.Fatalf("folded listing: %d letters, copies %v, count %d; want 2 letters, 2 and 1 copies, a count of 3",
			len(ls.Letters), copies, ls.Groups[0].Count)
	}
	if n := len(b.list(t, dlq.Filter{}).Letters); n != 3 {
		t.Fatalf("unfolded listing: %d letters, want 3", n)
	}
}
