package dlq_test

import (
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/dlq"
)

// A Kafka dead letter from the year -10700 used to be indexed as 2154: it
// looked young to the retention check of replay and matched --since. It is
// indexed with its time unknown (morta_en NULL, temps_desconegut), with the
// letter behind it; --since and --until never select it, the groups still
// count it, and replay refuses it without --force.
func TestKafkaOutOfRangeTimestampIsIndexedAsUnknown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ancient := time.Date(-10700, 1, 1, 0, 0, 0, 0, time.UTC)
	badID, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x",
		deadAt: ancient, firstFailure: ancient, eventTime: time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)})
	goodID, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
	if res := b.sync(t); len(res.New) != 2 {
		t.Fatalf("sync indexed %d new letters, want 2", len(res.New))
	}
	bad, err := b.store.Get(b.ctx, badID)
	if err != nil || !bad.TimeUnknown || !bad.DeadAt.IsZero() || !bad.FirstFailure.IsZero() || !bad.EventTime.IsZero() {
		t.Fatalf("letter from -10700: %+v, %v; want every time unknown", bad, err)
	}
	if v := dlq.View(bad, false); v.DeadAt != nil || !v.TimeUnknown {
		t.Fatalf("view: morta_en %v, temps_desconegut %v; want null and true", v.DeadAt, v.TimeUnknown)
	}
	now := time.Now()
	for _, f := range []dlq.Filter{{Since: now.Add(-time.Hour)}, {Until: now.Add(time.Hour)},
		{Since: time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC)}} {
		ls, err := b.store.List(b.ctx, f)
		if err != nil || len(ls) > 1 || (len(ls) == 1 && ls[0].ID != goodID) {
			t.Fatalf("filter %+v: %d letters, %v; the unknown time must not match", f, len(ls), err)
		}
	}
	groups, err := b.store.Summary(b.ctx, dlq.Filter{})
	if err != nil || len(groups) != 1 || groups[0].Count != 2 {
		t.Fatalf("summary: %+v, %v; want one group of 2", groups, err)
	}
	rep, err := b.svc.Replay(b.ctx, dlq.Filter{IDs: []string{badID}}, dlq.ReplayOptions{})
	if err != nil || rep.Refused != 1 || !strings.Contains(rep.Items[0].Refused, "age is unknown") || b.records(t, comandes) != 0 {
		t.Fatalf("replay of a letter of unknown age: %+v, %v; want it refused", rep, err)
	}
}
