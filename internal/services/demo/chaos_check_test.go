package demo

import (
	"testing"

	"github.com/km0/km0/contract"
	"github.com/twmb/franz-go/pkg/kgo"
)

func rec(key, id string) *kgo.Record {
	return &kgo.Record{Key: []byte(key), Headers: []kgo.RecordHeader{{Key: contract.HeaderEventID, Value: []byte(id)}}}
}

// The chaos run's "every outbox row on its topic, in order per aggregate"
// check: a republished batch keeps order by first occurrence; a missing id,
// or two ids of one aggregate whose first copies are swapped, fail it;
// poison records (ids in no outbox) are not counted against it.
func TestCompareTopicFindsLostAndReorderedEvents(t *testing.T) {
	want := map[string][]string{"P-1": {"a1", "a2", "a3"}, "P-2": {"b1", "b2"}}
	var tc TopicCount
	ok := []*kgo.Record{rec("P-1", "a1"), rec("P-2", "b1"), rec("P-1", "a2"), rec("X", "verí"), rec("P-1", "a1"), rec("P-1", "a2"), rec("P-1", "a3"), rec("P-2", "b2")}
	if n := compareTopic(want, ok, &tc); n != 0 || tc.Missing != 0 || tc.Republished != 2 || tc.Distinct != 5 || tc.Records != 8 {
		t.Fatalf("republished in order: %d out of order, %+v", n, tc)
	}
	tc = TopicCount{}
	lost := []*kgo.Record{rec("P-1", "a1"), rec("P-1", "a3"), rec("P-2", "b1"), rec("P-2", "b2")}
	if n := compareTopic(want, lost, &tc); n != 1 || tc.Missing != 1 {
		t.Fatalf("a2 lost: %d out of order, %d missing", n, tc.Missing)
	}
	tc = TopicCount{}
	swapped := []*kgo.Record{rec("P-1", "a1"), rec("P-1", "a2"), rec("P-1", "a3"), rec("P-2", "b2"), rec("P-2", "b1")}
	if n := compareTopic(want, swapped, &tc); n != 1 || tc.Missing != 0 {
		t.Fatalf("b1/b2 swapped: %d out of order, %d missing", n, tc.Missing)
	}
}
