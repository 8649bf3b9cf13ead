package analitica

import "sync"

// RecentEventsDefault is how many id_esdeveniment analitica remembers as
// counted (the latest ones): a copy of one of them (the relay republishing
// a row it could not mark, a dead letter replayed) is not counted again. About
// 100 bytes each: some 10 MB. A copy of an older event, or any copy after a
// restart, counts again.
const RecentEventsDefault = 100_000

// recentIDs is a bounded set of ids: the latest size added, oldest evicted
// first. It is safe for concurrent use.
type recentIDs struct {
	mu   sync.Mutex
	slot map[string]int // id → its slot in ring
	ring []string
	next int // the slot to evict once ring is full
	size int
}

func newRecentIDs(size int) *recentIDs {
	return &recentIDs{slot: make(map[string]int, size), size: size}
}

// add records id and reports whether it was new (false: a copy, already in
// the set).
func (r *recentIDs) add(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.slot[id]; ok {
		return false
	}
	i := len(r.ring)
	if i < r.size {
		r.ring = append(r.ring, id)
	} else {
		i = r.next
		if old := r.ring[i]; r.slot[old] == i {
			delete(r.slot, old)
		}
		r.ring[i] = id
		r.next = (i + 1) % r.size
	}
	r.slot[id] = i
	return true
}

// remove forgets id (its count failed: a copy may count it).
func (r *recentIDs) remove(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.slot, id)
}
