package dlq_test

import (
	"bytes"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// Fix-and-replay, the replay step. One comanda.creada has
// two consumers: inventari.descompte_estoc applied it; repartiment.assignacio
// dead-lettered it (permanent: esquema). Replay republishes the letter to
// comandes.esdeveniments with the same key, value and id_esdeveniment and no
// retry/DLQ headers. Fed the replayed record, the consumer that had applied
// the effect reports a duplicate (its effect count stays 1) and the one that
// had not applies it once; a redelivery of the replay changes nothing.
func TestReplayRepublishesSameEventAndInboxAbsorbsDuplicate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := b.ctx
	if _, err := b.schema.Pool.Exec(ctx, `CREATE TABLE efectes (consumidor TEXT NOT NULL, id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	ib := inbox.New(inbox.Config{Names: b.schema.Names()})
	apply := func(consumer string, m *transport.Message) inbox.Result {
		t.Helper()
		id, _ := m.Header(contract.HeaderEventID)
		res, err := ib.Process(ctx, b.schema.Pool, consumer, id, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO efectes VALUES ($1, $2)", consumer, id)
			return err
		})
		if err != nil {
			t.Fatalf("%s: %v", consumer, err)
		}
		return res
	}
	effects := func(consumer string) int {
		var n int
		if err := b.schema.Pool.QueryRow(ctx, "SELECT count(*) FROM efectes WHERE consumidor = $1", consumer).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// The original event, as the relay published it, and what its consumers did.
	eventID := "0b6f9e2c-7a43-4f1e-9d55-3f1c2a8e6b01"
	value := event(t, eventID, time.Now())
	orig := &transport.Message{Topic: comandes, Key: []byte("P-2026-000123"), Value: value,
		Headers: []transport.Header{{Key: "tipus", Value: "comanda.creada"}, {Key: "id_esdeveniment", Value: eventID}}}
	if err := kafka.NewPublisher(b.client).Publish(ctx, []*transport.Message{orig}); err != nil {
		t.Fatal(err)
	}
	if r := apply("inventari.descompte_estoc", orig); r != inbox.Processed {
		t.Fatalf("first delivery: %v", r)
	}
	id, _ := b.produceDead(t, dead{topic: comandes, key: "P-2026-000123", value: value, eventID: eventID,
		reason: "permanent: esquema: adreca_lliurament absent in a versio 1 event"})
	b.sync(t)

	rep := b.replay(t, dlq.Filter{Reason: "permanent: esquema"}, dlq.ReplayOptions{})
	if rep.Selected != 1 || rep.Done != 1 || rep.Refused != 0 || rep.Items[0].ID != id {
		t.Fatalf("replay report: %+v", rep)
	}
	if n, r := b.records(t, comandes), b.records(t, comandesRetry); n != 1 || r != 1 {
		t.Fatalf("%s holds %d records, %s %d; want 1 and 1 (the original, and the replay addressed to repartiment)",
			comandes, n, comandesRetry, r)
	}
	recs := kafkatest.ReadAll(t, b.broker, comandesRetry, 1, 10*time.Second)
	var replayed *kgo.Record
	for _, r := range recs {
		for _, h := range r.Headers {
			if h.Key == dlq.HeaderReplayedFrom && string(h.Value) == id {
				replayed = r
			}
		}
	}
	if replayed == nil {
		t.Fatalf("no record on %s carries %s=%s", comandes, dlq.HeaderReplayedFrom, id)
	}
	m := kafka.FromRecord(replayed)
	if string(m.Key) != "P-2026-000123" || string(m.Value) != string(value) {
		t.Fatalf("replay changed key or value: %q %q", m.Key, m.Value)
	}
	if h, _ := m.Header("id_esdeveniment"); h != eventID {
		t.Fatalf("id_esdeveniment header %q, want %q", h, eventID)
	}
	if h, _ := m.Header("tipus"); h != "comanda.creada" {
		t.Fatalf("tipus header %q", h)
	}
	if g, _ := m.Header("grup_consumidor"); g != "repartiment" {
		t.Fatalf("replay addressed to %q, want the group that dead-lettered it (repartiment)", g)
	}
	if n, _ := m.Header("intents"); n != "1" {
		t.Fatalf("replay's intents %q, want 1 (a retry copy due now)", n)
	}
	for _, gone := range []string{"motiu", "no_abans", "ultim_error", "topic_original",
		"particio_original", "offset_original", "primera_fallada"} {
		if _, ok := m.Header(gone); ok {
			t.Fatalf("replayed record still carries header %s", gone)
		}
	}

	if r := apply("inventari.descompte_estoc", m); r != inbox.Duplicate {
		t.Fatalf("consumer that had applied the effect: %v, want duplicat", r)
	}
	if r := apply("repartiment.assignacio", m); r != inbox.Processed {
		t.Fatalf("consumer that had dead-lettered it: %v, want processat", r)
	}
	if r := apply("repartiment.assignacio", m); r != inbox.Duplicate {
		t.Fatalf("redelivered replay: %v, want duplicat", r)
	}
	if a, r := effects("inventari.descompte_estoc"), effects("repartiment.assignacio"); a != 1 || r != 1 {
		t.Fatalf("effects: inventari %d, repartiment %d; want 1 and 1", a, r)
	}
	l := b.get(t, id)
	if l.State != dlq.StateReplayed || l.Replays != 1 || l.ReplayedAt.IsZero() {
		t.Fatalf("letter after replay: state %s, replays %d", l.State, l.Replays)
	}
}

// Replaying twice is refused unless forced; a forced replay publishes again.
func TestReplayTwiceNeedsForce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "transitori esgotat: mapes: 503"})
	b.sync(t)
	if rep := b.replay(t, dlq.Filter{IDs: []string{id}}, dlq.ReplayOptions{}); rep.Done != 1 {
		t.Fatalf("first replay: %+v", rep)
	}
	rep := b.replay(t, dlq.Filter{IDs: []string{id}}, dlq.ReplayOptions{})
	if rep.Done != 0 || rep.Refused != 1 || !strings.Contains(rep.Items[0].Refused, "already replayed") {
		t.Fatalf("second replay: %+v", rep)
	}
	if n := b.records(t, comandesRetry); n != 1 {
		t.Fatalf("%d records after a refused replay, want 1", n)
	}
	rep = b.replay(t, dlq.Filter{IDs: []string{comandesDLQ + "/0/999"}}, dlq.ReplayOptions{})
	if rep.Selected != 1 || rep.Refused != 1 || !strings.Contains(rep.Items[0].Refused, "not in the index") {
		t.Fatalf("unknown id: %+v", rep)
	}
	if rep := b.replay(t, dlq.Filter{IDs: []string{id}}, dlq.ReplayOptions{Force: true}); rep.Done != 1 {
		t.Fatalf("forced replay: %+v", rep)
	}
	if n, l := b.records(t, comandesRetry), b.get(t, id); n != 2 || l.Replays != 2 {
		t.Fatalf("after forced replay: %d records, %d replays; want 2 and 2", n, l.Replays)
	}
}

// A letter older than the idempotency retention is refused without --force:
// the consumers may have purged its key, so a duplicate would be applied
// again. Age is measured from the oldest of data_ms, primera_fallada and the
// dead time.
func TestReplayRefusesLetterOlderThanRetention(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := time.Now().Add(-20 * 24 * time.Hour)
	byFailure, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: a", firstFailure: old, eventTime: old})
	byEvent, _ := b.produceDead(t, dead{topic: comandes, key: "P-2", reason: "permanent: esquema: b", eventTime: old})
	fresh, _ := b.produceDead(t, dead{topic: comandes, key: "P-3", reason: "permanent: esquema: c"})
	b.sync(t)

	rep := b.replay(t, dlq.Filter{}, dlq.ReplayOptions{})
	if rep.Selected != 3 || rep.Done != 1 || rep.Refused != 2 {
		t.Fatalf("report: %+v", rep)
	}
	if done := ids(rep, true); len(done) != 1 || done[0] != fresh {
		t.Fatalf("replayed %v, want only %s", done, fresh)
	}
	for _, it := range rep.Items {
		if !it.Done && !strings.Contains(it.Refused, "retention") {
			t.Fatalf("refusal of %s does not name the retention: %q", it.ID, it.Refused)
		}
	}
	if n := b.records(t, comandesRetry); n != 1 {
		t.Fatalf("%d records published, want 1", n)
	}
	if n := b.rows(t, dlq.StatePending); n != 2 {
		t.Fatalf("%d letters pending, want 2", n)
	}
	// A longer retention (the consumers keep keys 30 days) accepts them.
	rep = b.replay(t, dlq.Filter{IDs: []string{byEvent}}, dlq.ReplayOptions{Retention: 30 * 24 * time.Hour})
	if rep.Done != 1 {
		t.Fatalf("with a 30-day retention: %+v", rep)
	}
	rep = b.replay(t, dlq.Filter{IDs: []string{byFailure}}, dlq.ReplayOptions{Force: true})
	if rep.Done != 1 || b.records(t, comandesRetry) != 3 || b.rows(t, dlq.StatePending) != 0 {
		t.Fatalf("forced: %+v, %d records, %d pending", rep, b.records(t, comandesRetry), b.rows(t, dlq.StatePending))
	}
}

// An event without data_ms that a lagging group dead-lettered late: its
// primera_fallada is recent, but another group may have stored (and purged)
// its key since the source record was written. data_original, the source
// record's timestamp, makes the letter old enough to refuse.
func TestReplayAgesALetterWithoutDataMSFromItsSourceRecord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := time.Now().Add(-20 * 24 * time.Hour)
	id := uuid.NewString()
	noTime := []byte(`{"id_esdeveniment":"` + id + `","tipus":"comanda.creada","versio":1,"origen":"comandes","dades":{"id":"P-2026-000123"}}`)
	lagging, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: a", eventID: id, value: noTime, originalTime: old})
	b.sync(t)
	rep := b.replay(t, dlq.Filter{}, dlq.ReplayOptions{})
	if rep.Selected != 1 || rep.Done != 0 || rep.Refused != 1 || !strings.Contains(rep.Items[0].Refused, "retention") {
		t.Fatalf("report: %+v", rep)
	}
	if n := b.records(t, comandesRetry); n != 0 {
		t.Fatalf("%d records published, want 0", n)
	}
	if rep := b.replay(t, dlq.Filter{IDs: []string{lagging}}, dlq.ReplayOptions{Force: true}); rep.Done != 1 {
		t.Fatalf("forced: %+v", rep)
	}
}

// A dry run reports what it would replay and publishes and marks nothing.
func TestReplayDryRunPublishesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, k := range []string{"P-1", "P-2", "P-3"} {
		b.produceDead(t, dead{topic: comandes, key: k, reason: "permanent: esquema: x"})
	}
	b.sync(t)
	rep := b.replay(t, dlq.Filter{Topic: comandes}, dlq.ReplayOptions{DryRun: true})
	if !rep.DryRun || rep.Selected != 3 || rep.Done != 3 {
		t.Fatalf("dry run report: %+v", rep)
	}
	if n := b.records(t, comandesRetry); n != 0 {
		t.Fatalf("dry run published %d records", n)
	}
	if n := b.rows(t, dlq.StatePending); n != 3 {
		t.Fatalf("dry run changed states: %d pending, want 3", n)
	}
}

// Purge needs confirmation; it marks letters purged (the records stay on the
// topic); with DeleteRecords it deletes records only up to the lowest offset
// still pending in the partition.
func TestPurgeNeedsConfirmationAndKeepsPendingRecords(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var letters []string
	for range 4 {
		id, _ := b.produceDead(t, dead{topic: comandes, key: "P-same", reason: "permanent: estoc insuficient: x"})
		letters = append(letters, id)
	}
	b.sync(t)
	if _, err := b.svc.Purge(b.ctx, dlq.Filter{}, dlq.PurgeOptions{}); !errors.Is(err, dlq.ErrNotConfirmed) {
		t.Fatalf("unconfirmed purge: %v, want ErrNotConfirmed", err)
	}
	if n := b.rows(t, dlq.StatePending); n != 4 {
		t.Fatalf("unconfirmed purge changed %d letters", 4-n)
	}
	_, partition, _, err := dlq.ParseKafkaID(letters[0])
	if err != nil {
		t.Fatal(err)
	}
	start := func() int64 {
		offs, err := b.adm.ListStartOffsets(b.ctx, comandesDLQ)
		if err != nil {
			t.Fatal(err)
		}
		o, _ := offs.Lookup(comandesDLQ, partition)
		return o.Offset
	}
	// Purge offsets 0 and 1, and delete records: 2 is pending, so delete up to 2.
	rep, err := b.svc.Purge(b.ctx, dlq.Filter{IDs: letters[:2]}, dlq.PurgeOptions{Confirmed: true, DeleteRecords: true})
	if err != nil || rep.Done != 2 {
		t.Fatalf("purge: %+v %v", rep, err)
	}
	if s := start(); s != 2 || len(rep.Deleted) != 1 || rep.Deleted[0].Offset != 2 {
		t.Fatalf("log start %d, deleted %+v; want 2", s, rep.Deleted)
	}
	// Purge offset 3 only: 2 is still pending, nothing more may go.
	if _, err := b.svc.Purge(b.ctx, dlq.Filter{IDs: letters[3:]}, dlq.PurgeOptions{Confirmed: true, DeleteRecords: true}); err != nil {
		t.Fatal(err)
	}
	if s := start(); s != 2 {
		t.Fatalf("log start %d after purging past a pending letter, want 2", s)
	}
	if p, q := b.rows(t, dlq.StatePurged), b.rows(t, dlq.StatePending); p != 3 || q != 1 {
		t.Fatalf("purged %d, pending %d; want 3 and 1", p, q)
	}
	// The index keeps the bytes of deleted records: show still works, and a
	// Sync after the deletion re-indexes nothing.
	if l := b.get(t, letters[0]); l.State != dlq.StatePurged || len(l.Value) == 0 {
		t.Fatalf("purged letter: %s, %d bytes", l.State, len(l.Value))
	}
	if res := b.sync(t); len(res.New) != 0 {
		t.Fatalf("sync after delete found %d new letters", len(res.New))
	}
	// Purging an already purged letter is reported, not repeated.
	rep, err = b.svc.Purge(b.ctx, dlq.Filter{IDs: letters[:1]}, dlq.PurgeOptions{Confirmed: true})
	if err != nil || rep.Done != 0 || rep.Refused != 1 {
		t.Fatalf("re-purge: %+v %v", rep, err)
	}
}

// A poison letter (not a valid envelope) is refused without --force: it would
// dead-letter again, and nothing could deduplicate it.
func TestReplayRefusesUndecodableLetter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", value: []byte("{oops"), noIDHeaders: true,
		reason: "permanent: envelope: malformed JSON"})
	b.sync(t)
	rep := b.replay(t, dlq.Filter{}, dlq.ReplayOptions{})
	if rep.Refused != 1 || rep.Done != 0 || !strings.Contains(rep.Items[0].Refused, "not a valid envelope") {
		t.Fatalf("report: %+v", rep)
	}
	if n := b.records(t, comandesRetry); n != 0 {
		t.Fatalf("%d records published", n)
	}
	if rep := b.replay(t, dlq.Filter{IDs: []string{id}}, dlq.ReplayOptions{Force: true}); rep.Done != 1 || b.records(t, comandesRetry) != 1 {
		t.Fatalf("forced: %+v", rep)
	}
}

// Letters of one key are republished in their DLQ order (offset order), even
// when their timestamps disagree (clocks of different consumer instances).
func TestReplayKeepsDLQOrderPerKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	now := time.Now()
	var want []string
	for i := range 3 {
		_, eid := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x",
			deadAt: now.Add(-time.Duration(i) * time.Minute)}) // later offsets, earlier timestamps
		want = append(want, eid)
	}
	b.sync(t)
	if rep := b.replay(t, dlq.Filter{}, dlq.ReplayOptions{}); rep.Done != 3 {
		t.Fatalf("replay: %+v", rep)
	}
	recs := kafkatest.ReadAll(t, b.broker, comandesRetry, 3, 10*time.Second)
	if len(recs) != 3 {
		t.Fatalf("read %d records, want 3", len(recs))
	}
	for i, r := range recs {
		if got, _ := kafka.FromRecord(r).Header("id_esdeveniment"); got != want[i] {
			t.Fatalf("record %d is %s, want %s (DLQ order)", i, got, want[i])
		}
	}
}

// Purge needs only the IDs and positions of the letters it marks, never
// their bytes: purging a DLQ of big letters must not hold their values in
// memory (200 letters of 256 KiB = 50 MiB of values; Purge may allocate at
// most a fifth of that). Not parallel: it reads the process's allocation
// count, which tests running beside it would add to (17 MiB once).
func TestPurgeDoesNotLoadTheLettersBytes(t *testing.T) {
	b := setup(t)
	value := bytes.Repeat([]byte("x"), 256<<10)
	now := time.Now()
	letters := make([]*dlq.Letter, 200)
	for i := range letters {
		letters[i] = dlq.NewLetter(comandesDLQ, 0, int64(i), now, &transport.Message{Value: value,
			Headers: []transport.Header{{Key: contract.HeaderReason, Value: "permanent: esquema: x"}}})
	}
	for i := 0; i < len(letters); i += 20 {
		if _, err := b.store.Insert(b.ctx, letters[i:i+20]); err != nil {
			t.Fatal(err)
		}
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	rep, err := b.svc.Purge(b.ctx, dlq.Filter{Reason: "permanent: esquema"}, dlq.PurgeOptions{Confirmed: true})
	runtime.ReadMemStats(&after)
	if err != nil || rep.Done != len(letters) {
		t.Fatalf("purge: %+v, %v", rep, err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > uint64(len(letters)*len(value)/5) {
		t.Fatalf("purging %d letters allocated %d MiB, more than a fifth of their %d MiB of values",
			len(letters), alloc>>20, len(letters)*len(value)>>20)
	}
}
