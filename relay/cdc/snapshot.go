package cdc

import (
	"fmt"
	"strconv"
	"strings"
)

// snapshot is which transactions a snapshot shows committed
// (pg_current_snapshot()), in the 32-bit transaction ids of the stream's
// Begin messages.
type snapshot struct {
	xmin, xmax uint32
	xip        map[uint32]bool // in progress when it was taken
}

// parseSnapshot reads pg_current_snapshot()'s text, xmin:xmax:xip,...
func parseSnapshot(s string) (snapshot, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return snapshot{}, fmt.Errorf("snapshot %q: want xmin:xmax:xip_list", s)
	}
	xid := func(v string) (uint32, error) {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("snapshot %q: %w", s, err)
		}
		return uint32(n), nil // the epoch is not in the stream's ids
	}
	var snap snapshot
	var err error
	if snap.xmin, err = xid(parts[0]); err != nil {
		return snapshot{}, err
	}
	if snap.xmax, err = xid(parts[1]); err != nil {
		return snapshot{}, err
	}
	if parts[2] != "" {
		ids := strings.Split(parts[2], ",")
		snap.xip = make(map[uint32]bool, len(ids))
		for _, v := range ids {
			x, err := xid(v)
			if err != nil {
				return snapshot{}, err
			}
			snap.xip[x] = true
		}
	}
	return snap, nil
}

// committed reports whether the snapshot shows committed transaction xid,
// which did commit (the stream carries nothing else): it ended before the
// snapshot was taken. As PostgreSQL's XidInMVCCSnapshot, in modulo-2^32
// order (the stream's transactions are well within 2^31 of the snapshot's).
func (s snapshot) committed(xid uint32) bool {
	if precedes(xid, s.xmin) {
		return true
	}
	if !precedes(xid, s.xmax) {
		return false
	}
	return !s.xip[xid]
}

// precedes is PostgreSQL's TransactionIdPrecedes for normal ids.
func precedes(a, b uint32) bool { return int32(a-b) < 0 }
