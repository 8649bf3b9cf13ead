package cdc_test

import (
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
)

// With DeletePublished each row is deleted once the broker confirmed it:
// the catch-up's rows (by ctid) at the first start and the streamed rows of
// concurrent writers (by id, also when the stream is ahead of visibility),
// every event once and in commit order per aggregate, and a parked row and
// the one behind it stay, pending. No batch waits for rows it already
// deleted ("not found to mark").
func TestDeletePublishedLeavesOnlyPendingRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const aggs, pre, writers, perWriter = 10, 200, 4, 60
	for i := range pre {
		b.enqueue(t, fmt.Sprintf("A-%d", i%aggs), relaytest.SeqPayload{Seq: i/aggs + 1})
	}
	pub := &refusing{next: b.pub, mark: "refuse-me"}
	pub.refuse.Store(true)
	logs := &testlog.Buffer{}
	cfg := b.config()
	cfg.Publisher = pub
	cfg.DeletePublished = true
	cfg.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	r := newRelay(t, cfg)
	start(t, r)
	testkit.Eventually(t, 10*time.Second, "the relay to hold the slot", r.Active)
	b.enqueue(t, "P", bigPayload{Seq: 1, Pad: "refuse-me"})
	// Once P1 is parked: a later row in the very Publish the broker refused
	// would be confirmed, and deleted (C8).
	testkit.Eventually(t, 10*time.Second, "P1 parked", func() bool { return b.count(t, "SELECT count(*) FROM outbox_aparcats") == 1 })
	b.enqueue(t, "P", relaytest.SeqPayload{Seq: 2})
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := 1; i <= perWriter; i++ {
				b.enqueue(t, fmt.Sprintf("W-%d", w), relaytest.SeqPayload{Seq: i})
			}
		})
	}
	wg.Wait()
	want := map[string]int{}
	for i := range aggs {
		want[fmt.Sprintf("A-%d", i)] = pre / aggs
	}
	for w := range writers {
		want[fmt.Sprintf("W-%d", w)] = perWriter
	}
	total := pre + writers*perWriter
	testkit.Eventually(t, 20*time.Second, "every row but P's deleted", func() bool {
		return b.count(t, "SELECT count(*) FROM outbox") == 2
	})

	if p, parked := b.pending(t), b.count(t, "SELECT count(*) FROM outbox_aparcats"); p != 2 || parked != 1 {
		t.Fatalf("%d pending, %d parked; want P's 2 pending, 1 parked", p, parked)
	}
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, total))
	delete(perKey, "P")
	relaytest.CheckCommitOrder(t, perKey, want)
	if len(copies) != total {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), total)
	}
	for id, c := range copies {
		if c != 1 {
			t.Fatalf("event %s published %d times, want once (no crash)", id, c)
		}
	}
	if l := logs.String(); strings.Contains(l, "not found to mark") {
		t.Fatalf("the marker waited for rows it had deleted:\n%s", l)
	}
}
