package cdc

import "testing"

// A catch-up's snapshot decides which streamed transactions it already
// holds: those that ended before it was taken (below xmin, or below xmax
// and not in progress), in modulo-2^32 order across the wrap of 32-bit ids.
func TestSnapshotCommittedIsPostgreSQLsVisibility(t *testing.T) {
	snap, err := parseSnapshot("4294967300:4294967310:4294967303,4294967305")
	if err != nil {
		t.Fatal(err)
	}
	// 4294967300 is 4 in the stream's 32-bit ids (epoch 1).
	for xid, want := range map[uint32]bool{
		3: true, 4294967290: true, // before xmin (the latter: before the wrap)
		4: true, 6: true, 8: true, 13: true, // below xmax, not in progress
		7: false, 9: false, // in progress when the snapshot was taken
		14: false, 20: false, // at or after xmax
	} {
		if got := snap.committed(xid); got != want {
			t.Errorf("committed(%d) = %v, want %v", xid, got, want)
		}
	}
	if s, err := parseSnapshot("10:10:"); err != nil || !s.committed(9) || s.committed(10) {
		t.Errorf("10:10: → %+v, %v", s, err)
	}
	for _, bad := range []string{"", "1:2", "a:2:", "1:2:x", "1:2:3:4"} {
		if _, err := parseSnapshot(bad); err == nil {
			t.Errorf("parseSnapshot(%q): no error", bad)
		}
	}
}
