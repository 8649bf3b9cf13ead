package analitica

import "sync"

// RecentEventsDefault is how many id_esdeveniment analitica remembers as
// counted (the latest ones), each with the PostgreSQL transaction that
// counted it: a copy of one of them (the relay republishing a row it could
// not mark, a dead letter replayed) is not counted again unless that
// transaction rolled back. About 120 bytes each: some 12 MB. A copy of an
// older event, or any copy after a restart, counts again.
const RecentEventsDefault = 100_000

// recentIDs is a bounded set of ids, each with the transaction id (xid8)
// that counted it, 0 while its count is under way: the latest size added,
// oldest evicted first. It is safe for concurrent use.
type recentIDs struct {
	mu   sync.Mutex
	m    map[string]recent
	ring []string
	next int // the slot to evict once ring is full
	size int
}

type recent struct {
	slot int    // in ring
	xid  uint64 // the counting transaction; 0: under way
}

func newRecentIDs(size int) *recentIDs {
	return &recentIDs{m: make(map[string]recent, size), size: size}
}

// reserve records id as being counted and returns (0, false) when it was not
// in the set; else it changes nothing and returns the transaction that
// counted it (0: a count under way) and true.
func (r *recentIDs) reserve(id string) (uint64, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e, ok := r.m[id]; ok {
		return e.xid, true
	}
	i := len(r.ring)
	if i < r.size {
		r.ring = append(r.ring, id)
	} else {
		i = r.next
		if old := r.ring[i]; r.m[old].slot == i {
			delete(r.m, old)
		}
		r.ring[i] = id
		r.next = (i + 1) % r.size
	}
	r.m[id] = recent{slot: i}
	return 0, false
}

// retake marks id as being counted again if it is still counted by xid (a
// transaction that rolled back) and reports whether it did: false when
// another handler took it first or it was evicted.
func (r *recentIDs) retake(id string, xid uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.m[id]
	if !ok || e.xid != xid {
		return false
	}
	e.xid = 0
	r.m[id] = e
	return true
}

// counted records that transaction xid counted id.
func (r *recentIDs) counted(id string, xid uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e, ok := r.m[id]; ok {
		e.xid = xid
		r.m[id] = e
	}
}

// remove forgets id (its count failed: a copy may count it).
func (r *recentIDs) remove(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.m, id)
}
