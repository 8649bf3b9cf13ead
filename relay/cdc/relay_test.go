package cdc_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport"
)

func TestConfigIsValidatedAndNamesDefault(t *testing.T) {
	t.Parallel()
	if got := cdc.DefaultSlot(migrate.Names{}); got != "km0_public_outbox" {
		t.Fatalf("default slot %q, want km0_public_outbox", got)
	}
	odd := cdc.DefaultSlot(migrate.Names{Schema: "Botiga-Nord", Outbox: strings.Repeat("x", 80)})
	if len(odd) > 63 || strings.ToLower(odd) != odd || strings.ContainsAny(odd, "-") {
		t.Fatalf("default slot of odd names %q is not a slot name", odd)
	}
	if cdc.DefaultSlot(migrate.Names{Schema: "a-b"}) == cdc.DefaultSlot(migrate.Names{Schema: "a_b"}) {
		t.Fatal("two tables share a default slot")
	}
	_, err := cdc.New(cdc.Config{Config: relay.Config{DatabaseURL: "postgres://x@127.0.0.1/x", Publisher: transportNop{},
		Topic: "t", Origin: "o"}, Slot: "Bad-Slot", BatchSize: -1})
	if !errors.Is(err, cdc.ErrConfig) || !strings.Contains(err.Error(), "Slot") || !strings.Contains(err.Error(), "BatchSize") {
		t.Fatalf("New with a bad slot and batch: %v", err)
	}
	cfg := cdc.Config{Config: relay.Config{DatabaseURL: "postgres://x@127.0.0.1/x", Publisher: transportNop{},
		Topic: "t", Origin: "o", PruneOlderThan: time.Hour, DeletePublished: true}, WAL: true}
	if _, err := cdc.New(cfg); !errors.Is(err, cdc.ErrConfig) || !strings.Contains(err.Error(), "PruneOlderThan") ||
		!strings.Contains(err.Error(), "DeletePublished") {
		t.Fatalf("New in WAL mode with pruning and deleting: %v", err)
	}
}

type transportNop struct{}

func (transportNop) Publish(context.Context, []*transport.Message) error { return nil }

// The stream's rows go out with the polling relay's envelope, key and
// headers, and are marked published after the broker confirmed them.
func TestPublishesInsertsWithEnvelopeKeyAndHeadersThenMarks(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := newRelay(t, b.config())
	start(t, r)
	testkit.Eventually(t, 10*time.Second, "the relay to hold the slot", r.Active)
	ids := map[string]bool{}
	for i := 1; i <= 3; i++ {
		ids[b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: i}).String()] = true
	}
	testkit.Eventually(t, 10*time.Second, "3 rows marked", func() bool { return b.pending(t) == 0 })
	recs := b.read(t, 3)
	for _, rec := range recs {
		env, err := envelope.Decode(rec.Value)
		if err != nil {
			t.Fatal(err)
		}
		if string(rec.Key) != "P-1" || env.Origin != "comandes" || env.Type != "comanda.creada" || !ids[env.ID] {
			t.Fatalf("record key %q envelope %+v", rec.Key, env)
		}
		hs := map[string]string{}
		for _, h := range rec.Headers {
			hs[h.Key] = string(h.Value)
		}
		if hs[contract.HeaderType] != "comanda.creada" || hs[contract.HeaderEventID] != env.ID {
			t.Fatalf("headers %v", hs)
		}
	}
	perKey, _ := relaytest.FirstSeqs(t, recs)
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"P-1": 3})
}

// The same concurrent-writers proof as the polling relay's: 8 writers on
// 1,000 aggregates, a backlog written before the relay starts (the first
// start publishes it from the slot's snapshot) and more written while it
// streams. Nothing is missing, nothing is published twice, and each
// aggregate's events are in commit order.
func TestEightWritersKeepCommitOrder(t *testing.T) {

	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 1000)
	ctx := context.Background()
	if err := w.Run(ctx, 8, 100, 1); err != nil {
		t.Fatal(err)
	}
	cfg := b.config()
	cfg.BatchSize = 50 // many batches
	watch := &keyWatch{next: b.pub, inFlight: map[string]int{}}
	cfg.Publisher = watch
	r := newRelay(t, cfg)
	start(t, r)
	if err := w.Run(ctx, 8, 150, 2); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 60*time.Second, "every row published", func() bool { return b.pending(t) == 0 })
	want := w.Counts(t)
	n := relaytest.Total(want)
	if rows := b.count(t, "SELECT count(*) FROM outbox"); rows != n || n < 8*250 {
		t.Fatalf("writers committed %d events, outbox holds %d", n, rows)
	}
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, n))
	if len(copies) != n {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), n)
	}
	for id, c := range copies {
		if c != 1 {
			t.Fatalf("event %s published %d times without a failure", id, c)
		}
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	if watch.shared > 0 {
		t.Fatalf("%d Publish calls overlapped another in flight with records of the same aggregate", watch.shared)
	}
	t.Logf("%d events on %d aggregates, all in commit order, each once; %d Publish calls, %d of them beside another",
		n, len(want), watch.calls, watch.concurrent)
}

// keyWatch counts Publish calls that run while another is in flight, and
// those of them sharing a key with it (an aggregate at the broker twice at
// once could be reordered).
type keyWatch struct {
	next                      transport.Publisher
	mu                        sync.Mutex
	inFlight                  map[string]int
	calls, concurrent, shared int
	running                   int
}

func (w *keyWatch) Publish(ctx context.Context, msgs []*transport.Message) error {
	w.mu.Lock()
	w.calls++
	if w.running > 0 {
		w.concurrent++
	}
	seen := map[string]bool{}
	for _, m := range msgs {
		k := string(m.Key)
		if seen[k] {
			continue
		}
		seen[k] = true
		if w.inFlight[k] > 0 {
			w.shared++
		}
		w.inFlight[k]++
	}
	w.running++
	w.mu.Unlock()
	err := w.next.Publish(ctx, msgs)
	w.mu.Lock()
	w.running--
	for k := range seen {
		w.inFlight[k]--
	}
	w.mu.Unlock()
	return err
}
