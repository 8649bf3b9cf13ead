package kafkarr

import (
	"context"
	"sync"

	"github.com/twmb/franz-go/pkg/kgo"
)

// tracker records, per partition, the offsets taken from the broker and
// which of them are finished, so that the server commits only a prefix of
// finished records while later ones run ahead of a slow one. Records of a
// revoked or lost partition that have not started are skipped (their new
// owner reads them again from the committed offset).
type tracker struct {
	mu    sync.Mutex
	parts map[tp]*ptrack
	idle  *sync.Cond // signalled when a partition's running count drops
}

type tp struct {
	topic string
	part  int32
}

type ptrack struct {
	tp      tp
	epoch   int32
	next    int64   // offset to commit: everything below is finished
	queue   []int64 // offsets taken and not committable yet, in order
	done    map[int64]struct{}
	running int
	gone    bool // revoked or lost: do not start its records
	dirty   bool // next advanced since the last commit
}

func newTracker() *tracker {
	t := &tracker{parts: map[tp]*ptrack{}}
	t.idle = sync.NewCond(&t.mu)
	return t
}

// take registers recs (in poll order) and returns each one's partition.
func (t *tracker) take(recs []*kgo.Record) []*ptrack {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*ptrack, len(recs))
	for i, r := range recs {
		k := tp{r.Topic, r.Partition}
		p := t.parts[k]
		if p == nil {
			p = &ptrack{tp: k, next: r.Offset, done: map[int64]struct{}{}}
			t.parts[k] = p
		}
		p.epoch = r.LeaderEpoch
		p.queue = append(p.queue, r.Offset)
		out[i] = p
	}
	return out
}

// begin reports whether the record of p may run (its partition is still
// ours) and counts it as running.
func (t *tracker) begin(p *ptrack) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p.gone {
		return false
	}
	p.running++
	return true
}

// finish ends the record at offset of p: ran says whether begin let it run,
// done whether it is finished. A record that did not run (its partition was
// given up, or the server is stopping) or did not finish (its handler was
// cut short by the stop) stays unfinished: nothing at or after it is
// committed, and the group reads it again.
func (t *tracker) finish(p *ptrack, offset int64, ran, done bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if ran {
		p.running--
		if p.running == 0 {
			t.idle.Broadcast()
		}
	}
	if !ran || !done {
		return
	}
	p.done[offset] = struct{}{}
	for len(p.queue) > 0 {
		if _, ok := p.done[p.queue[0]]; !ok {
			break
		}
		delete(p.done, p.queue[0])
		p.next = p.queue[0] + 1
		p.dirty = true
		p.queue = p.queue[1:]
	}
}

// ready returns the offsets to commit of the partitions still ours whose
// committable offset advanced, and marks them committed.
func (t *tracker) ready() map[string]map[int32]kgo.EpochOffset {
	t.mu.Lock()
	defer t.mu.Unlock()
	return collect(t.parts)
}

func collect(parts map[tp]*ptrack) map[string]map[int32]kgo.EpochOffset {
	var out map[string]map[int32]kgo.EpochOffset
	for k, p := range parts {
		if !p.dirty {
			continue
		}
		p.dirty = false
		if out == nil {
			out = map[string]map[int32]kgo.EpochOffset{}
		}
		if out[k.topic] == nil {
			out[k.topic] = map[int32]kgo.EpochOffset{}
		}
		out[k.topic][k.part] = kgo.EpochOffset{Epoch: p.epoch, Offset: p.next}
	}
	return out
}

// detach gives up the partitions of m: their records that have not started
// are skipped. It waits (until ctx ends) for the running ones to finish and
// returns what they left to commit.
func (t *tracker) detach(ctx context.Context, m map[string][]int32) map[string]map[int32]kgo.EpochOffset {
	t.mu.Lock()
	defer t.mu.Unlock()
	gone := map[tp]*ptrack{}
	for topic, parts := range m {
		for _, part := range parts {
			k := tp{topic, part}
			if p := t.parts[k]; p != nil {
				p.gone = true
				gone[k] = p
				delete(t.parts, k)
			}
		}
	}
	stop := context.AfterFunc(ctx, func() {
		t.mu.Lock()
		t.idle.Broadcast()
		t.mu.Unlock()
	})
	defer stop()
	for ctx.Err() == nil {
		busy := false
		for _, p := range gone {
			busy = busy || p.running > 0
		}
		if !busy {
			break
		}
		t.idle.Wait()
	}
	return collect(gone)
}

// detachAll gives up every partition (shutdown).
func (t *tracker) detachAll(ctx context.Context) map[string]map[int32]kgo.EpochOffset {
	t.mu.Lock()
	m := map[string][]int32{}
	for k := range t.parts {
		m[k.topic] = append(m[k.topic], k.part)
	}
	t.mu.Unlock()
	return t.detach(ctx, m)
}
