package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport"
)

func TestConfigIsValidated(t *testing.T) {
	t.Parallel()
	_, err := relay.New(relay.Config{BatchSize: -1, Workers: 100})
	if !errors.Is(err, relay.ErrConfig) {
		t.Fatalf("want ErrConfig, got %v", err)
	}
	for _, want := range []string{"Pool or DatabaseURL", "Publisher", "Topic", "Origin", "BatchSize -1", "Workers 100"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	_, err = relay.New(relay.Config{DatabaseURL: "::not a url::", Publisher: nopPublisher{}, Topic: "t", Origin: "o"})
	if !errors.Is(err, relay.ErrConfig) || strings.Contains(err.Error(), "not a url") {
		t.Fatalf("bad URL: want ErrConfig without the URL, got %v", err)
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, []*transport.Message) error { return nil }

func TestPublishesEnvelopeWithKeyAndHeadersThenMarks(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := b.newRelay(t, b.config())
	ids := map[string]bool{}
	for i := range 30 {
		ids[b.enqueue(t, []string{"P-1", "P-2", "P-3"}[i%3], map[string]any{"i": i}).String()] = true
	}
	if n := b.drainOnce(t, r); n != 30 {
		t.Fatalf("published %d, want 30", n)
	}
	if p := b.pending(t); p != 0 {
		t.Fatalf("%d rows still pending", p)
	}
	recs := b.read(t, 30)
	if len(recs) != 30 {
		t.Fatalf("%d records, want 30", len(recs))
	}
	for _, rec := range recs {
		env, err := envelope.Decode(rec.Value)
		if err != nil {
			t.Fatal(err)
		}
		hdr := map[string]string{}
		for _, h := range rec.Headers {
			hdr[h.Key] = string(h.Value)
		}
		if !ids[env.ID] || hdr[contract.HeaderEventID] != env.ID || hdr[contract.HeaderType] != "comanda.creada" ||
			env.Origin != "comandes" || env.Version != 1 || env.TimeMS == 0 || !strings.HasPrefix(string(rec.Key), "P-") {
			t.Fatalf("bad record: key %s headers %v envelope %+v", rec.Key, hdr, env)
		}
	}
	lag, err := r.Lag(context.Background())
	if err != nil || lag.Pending != 0 || lag.Oldest != 0 {
		t.Fatalf("lag after draining: %+v %v", lag, err)
	}
}

// Crash point: the relay dies after Kafka confirmed every record of
// the batch and before the UPDATE that marks the rows (the AfterPublish crash point of internal/faults);
// with DeletePublished, before the DELETE that removes them.
func TestCrashAfterConfirmBeforeMarkRepublishesSameIDs(t *testing.T) {
	t.Parallel()
	for _, del := range []bool{false, true} {
		name := "publicat_en"
		if del {
			name = "DeletePublished"
		}
		t.Run(name, func(t *testing.T) { crashAfterConfirmBeforeMark(t, del) })
	}
}

func crashAfterConfirmBeforeMark(t *testing.T, del bool) {
	t.Parallel()
	b := setup(t)
	const events = 400 // two chunks of 250 and 150: the first chunk's UPDATE is sent before the crash
	ctx := context.Background()
	evs := make([]*outbox.Event, events)
	for i := range evs {
		evs[i] = &outbox.Event{Aggregate: "comanda", AggregateID: "P-" + string(rune('A'+i%20)), Type: "comanda.creada",
			Payload: relaytest.SeqPayload{Seq: i/20 + 1}}
	}
	for i := 0; i < events; i += 20 { // one transaction per round of the 20 aggregates
		if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.EnqueueBatch(ctx, tx, evs[i:i+20]) }); err != nil {
			t.Fatal(err)
		}
	}
	crashCfg := b.config()
	crashCfg.BatchSize = 1000
	crashCfg.DeletePublished = del
	var probe faults.Relay
	probe.AfterPublish = func(int) error { return faults.ErrCrashed }
	crashing := b.newRelay(t, crashCfg)
	withProbes(crashing, probe)
	if _, err := crashing.RunOnce(ctxFor(crashing)); !errors.Is(err, faults.ErrCrashed) {
		t.Fatalf("want the crash, got %v", err)
	}
	crashing.Close()
	if p, rows := b.pending(t), b.count(t, "SELECT count(*) FROM outbox"); p != events || rows != events {
		t.Fatalf("after the crash %d rows, %d pending, want all %d (nothing marked or deleted)", rows, p, events)
	}
	cfg := b.config()
	cfg.DeletePublished = del
	if n := b.drainOnce(t, b.newRelay(t, cfg)); n != events {
		t.Fatalf("second relay published %d, want %d", n, events)
	}
	if p := b.pending(t); p != 0 {
		t.Fatalf("%d rows still pending", p)
	}
	if rows, wantRows := b.count(t, "SELECT count(*) FROM outbox"), map[bool]int{false: events, true: 0}[del]; rows != wantRows {
		t.Fatalf("%d rows in the outbox after draining, want %d", rows, wantRows)
	}
	recs := b.read(t, 2*events)
	perKey, copies := relaytest.FirstSeqs(t, recs)
	dups := 0
	for _, c := range copies {
		if c != 2 {
			t.Fatalf("an id appears %d times, want exactly 2", c)
		}
		dups += c - 1
	}
	if len(recs) != 2*events || len(copies) != events || dups != events {
		t.Fatalf("records %d, distinct ids %d, duplicates %d; want %d, %d, %d", len(recs), len(copies), dups, 2*events, events, events)
	}
	want := map[string]int{}
	for i := range 20 {
		want["P-"+string(rune('A'+i))] = events / 20
	}
	relaytest.CheckCommitOrder(t, perKey, want)

	// An idempotent consumer absorbs the duplicates: one effect per event.
	if _, err := b.s.Pool.Exec(ctx, "CREATE TABLE efectes (id TEXT PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	in := inbox.New(inbox.Config{Names: b.s.Names()})
	processed, duplicates := 0, 0
	for _, rec := range recs {
		env, _ := envelope.Decode(rec.Value)
		res, err := in.Process(ctx, b.s.Pool, "test.efecte", env.ID, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO efectes VALUES ($1)", env.ID)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		if res == inbox.Processed {
			processed++
		} else {
			duplicates++
		}
	}
	if effects := b.count(t, "SELECT count(*) FROM efectes"); effects != events || processed != events || duplicates != events {
		t.Fatalf("effects %d, processed %d, duplicates %d; want %d each", effects, processed, duplicates, events)
	}
}

// Commit order differs from transaction start order: A begins first, B begins,
// writes and commits, then A writes and commits. With creat_en DEFAULT now()
// (transaction start) A would sort first; the outbox trigger stamps creat_en
// after taking the aggregate's lock, so B goes out first, as committed.
func TestCommitOrderBeatsTransactionStartOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	txA, err := b.s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer txA.Rollback(ctx) //nolint:errcheck
	var startA time.Time
	if err := txA.QueryRow(ctx, "SELECT now()").Scan(&startA); err != nil {
		t.Fatal(err)
	}
	b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: 1}) // B: begins after A, commits first
	if err := b.ob.Enqueue(ctx, txA, &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada",
		Payload: relaytest.SeqPayload{Seq: 2}}); err != nil {
		t.Fatal(err)
	}
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := b.drainOnce(t, b.newRelay(t, b.config())); n != 2 {
		t.Fatalf("published %d, want 2", n)
	}
	perKey, _ := relaytest.FirstSeqs(t, b.read(t, 2))
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"P-1": 2})
	if n := b.count(t, "SELECT count(*) FROM outbox WHERE carrega->>'seq' = '2' AND creat_en > $1", startA); n != 1 {
		t.Fatal("A's row was stamped with its transaction start; the trigger is not in place")
	}
}

// Two relay instances (two workers each, so four shard owners) and
// 8 concurrent writers on 1,000 aggregates. A backlog is written first, so
// that both instances drain it in parallel in small batches (where a plain
// SKIP LOCKED relay splits an aggregate's events across concurrent batches and
// publishes them out of order); the writers go on while they drain, and
// instance A leaves before the writers finish, so its shards change hands
// under load. Nothing is missing and each aggregate's events are in commit
// order.
func TestTwoRelaysEightWritersKeepCommitOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 1000)
	cfg := b.config()
	cfg.Workers, cfg.BatchSize = 2, 20
	relayA, relayB := b.newRelay(t, cfg), b.newRelay(t, cfg)
	ctx := context.Background()
	t0 := time.Now()
	if err := w.Run(ctx, 8, 150, 1); err != nil {
		t.Fatal(err)
	}
	t.Logf("backlog of %d written in %v", b.pending(t), time.Since(t0))
	stopA := start(t, relayA)
	start(t, relayB)
	if err := w.Run(ctx, 8, 100, 2); err != nil {
		t.Fatal(err)
	}
	if relayA.OwnedShards() == 0 || relayB.OwnedShards() == 0 {
		t.Fatalf("both instances should own shards: A %d, B %d", relayA.OwnedShards(), relayB.OwnedShards())
	}
	if err := stopA(); err != nil {
		t.Fatal(err)
	}
	if err := w.Run(ctx, 8, 50, 3); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "every row published", func() bool { return b.pending(t) == 0 })
	t.Logf("written and relayed in %v", time.Since(t0))

	want := w.Counts(t)
	n := relaytest.Total(want)
	if rows := b.count(t, "SELECT count(*) FROM outbox"); rows != n || n < 8*300 {
		t.Fatalf("writers committed %d events, outbox holds %d", n, rows)
	}
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, n))
	if len(copies) != n {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), n)
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	t.Logf("%d events on %d aggregates, all in commit order", n, len(want))
}
