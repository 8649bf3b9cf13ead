package analitica

import (
	"fmt"
	"testing"
)

// TestRecentIDsKeepsTheLatestSize: with room for 3, a copy of any of the
// latest 3 is refused; the 4th id evicts the oldest, which is then new
// again; a removed id is new again and its old slot evicts nothing else.
func TestRecentIDsKeepsTheLatestSize(t *testing.T) {
	r := newRecentIDs(3)
	for i := range 3 {
		if !r.add(fmt.Sprint(i)) {
			t.Fatalf("%d not new", i)
		}
	}
	for i := range 3 {
		if r.add(fmt.Sprint(i)) {
			t.Fatalf("copy of %d counted", i)
		}
	}
	if !r.add("3") || !r.add("0") { // 3 evicts 0; 0 evicts 1
		t.Fatal("3, then 0 after its eviction, must be new")
	}
	if r.add("2") || r.add("3") || !r.add("1") {
		t.Fatal("2 and 3 are recent, 1 was evicted")
	}
	r.remove("3")
	if !r.add("3") {
		t.Fatal("a removed id is new again")
	}
	if len(r.slot) != 3 || len(r.ring) != 3 {
		t.Fatalf("%d ids, %d slots: want 3 and 3", len(r.slot), len(r.ring))
	}
}
