package analitica

import (
	"fmt"
	"testing"
)

// TestRecentIDsKeepsTheLatestSize: with room for 3, a copy of any of the
// latest 3 is seen (with the transaction that counted it); the 4th id evicts
// the oldest, which is then new again; a removed id is new again and its old
// slot evicts nothing else; retake succeeds once, for the recorded xid only.
func TestRecentIDsKeepsTheLatestSize(t *testing.T) {
	t.Parallel()
	r := newRecentIDs(3)
	for i := range 3 {
		if _, seen := r.reserve(fmt.Sprint(i)); seen {
			t.Fatalf("%d not new", i)
		}
		r.counted(fmt.Sprint(i), uint64(100+i))
	}
	for i := range 3 {
		if xid, seen := r.reserve(fmt.Sprint(i)); !seen || xid != uint64(100+i) {
			t.Fatalf("copy of %d: %d %v, want %d true", i, xid, seen, 100+i)
		}
	}
	if _, seen := r.reserve("3"); seen { // evicts 0
		t.Fatal("3 must be new")
	}
	if _, seen := r.reserve("0"); seen { // evicts 1
		t.Fatal("0 must be new after its eviction")
	}
	if xid, seen := r.reserve("3"); !seen || xid != 0 {
		t.Fatalf("3 under way: %d %v, want 0 true", xid, seen)
	}
	if _, seen := r.reserve("1"); seen { // evicts 2
		t.Fatal("1 was evicted")
	}
	r.remove("3")
	if _, seen := r.reserve("3"); seen {
		t.Fatal("a removed id is new again")
	}
	if len(r.m) != 3 || len(r.ring) != 3 {
		t.Fatalf("%d ids, %d slots: want 3 and 3", len(r.m), len(r.ring))
	}
	r.counted("1", 7)
	if r.retake("1", 8) || !r.retake("1", 7) || r.retake("1", 7) {
		t.Fatal("retake: only the recorded xid, once")
	}
}
