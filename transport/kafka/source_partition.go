package kafka

import (
	"cmp"
	"container/heap"
	"slices"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/pause"
	"github.com/km0/km0/transport"
)

// partition is the worker of one assigned partition. Records of a domain
// partition are processed in offset order, BatchSize at a time; records of a
// retry partition are held until their no_abans and processed as they come
// due (see runRetry). Partitions run in parallel, at most Concurrency batches
// at once.
type partition struct {
	s      *Source
	topic  string
	part   int32
	source string // the domain topic (topic itself, or the topic of a .retry)
	retry  bool
	high   int // pause fetching above this many queued (+held) records
	low    int // resume at or below

	mu       sync.Mutex
	queue    []*kgo.Record // fetched, not started, offset order
	held     int           // retry copies waiting for their no_abans
	paused   bool
	pending  []epochOffset // dispatched, not finished, offset order
	finished map[int64]bool
	mark     kgo.EpochOffset // next offset to commit; Offset -1: none yet
	last     int64           // last committed offset
	hwm      int64           // the high watermark of the last fetch; -1: none yet

	routes  chan struct{}  // slots of batches being routed (process)
	routing sync.WaitGroup // those batches

	wake     chan struct{}
	quit     chan struct{}
	quitOnce sync.Once
	done     chan struct{}
}

type epochOffset struct {
	offset int64
	epoch  int32
	ts     time.Time // the record's timestamp
}

func newPartition(s *Source, topic string, part int32) *partition {
	source, retry := s.retryOf[topic]
	if !retry {
		source = topic
	}
	// Fetched records wait here decompressed: four batches ahead keep the
	// worker busy, and the bound keeps a backlog of large batches (inventari
	// runs 1,000) out of memory.
	high := max(4*s.set.BatchSize, 4096)
	if retry {
		high = s.cfg.MaxHeld
	}
	return &partition{
		s: s, topic: topic, part: part, source: source, retry: retry,
		high: high, low: high / 2,
		finished: map[int64]bool{},
		mark:     kgo.EpochOffset{Offset: -1, Epoch: -1},
		last:     -1,
		hwm:      -1,
		routes:   make(chan struct{}, routesPerPartition),
		wake:     make(chan struct{}, 1),
		quit:     make(chan struct{}),
		done:     make(chan struct{}),
	}
}

// push queues fetched records (poll loop), hwm being the partition's high
// watermark in that fetch. It never blocks: over the high water mark the
// partition is paused in the client instead, and the buffered records of a
// paused partition are re-fetched after the resume.
func (p *partition) push(recs []*kgo.Record, hwm int64) {
	p.mu.Lock()
	p.queue = append(p.queue, recs...)
	for _, r := range recs {
		p.pending = append(p.pending, epochOffset{r.Offset, r.LeaderEpoch, r.Timestamp})
	}
	if !p.paused && len(p.queue)+p.held > p.high {
		p.paused = true
		p.s.cl.PauseFetchPartitions(map[string][]int32{p.topic: {p.part}})
	}
	p.hwm = max(p.hwm, hwm)
	lag, oldest := p.lagLocked()
	p.mu.Unlock()
	p.reportLag(lag, oldest)
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// take removes up to n queued records (n <= 0: all) and resumes fetching when
// the queue has drained to the low water mark.
func (p *partition) take(n int) []*kgo.Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	if n <= 0 || n > len(p.queue) {
		n = len(p.queue)
	}
	out := p.queue[:n:n]
	p.queue = p.queue[n:]
	if len(p.queue) == 0 {
		p.queue = nil
	}
	p.resumeLocked()
	return out
}

func (p *partition) resumeLocked() {
	if p.paused && len(p.queue)+p.held <= p.low {
		p.paused = false
		p.s.cl.ResumeFetchPartitions(map[string][]int32{p.topic: {p.part}})
	}
}

func (p *partition) setHeld(n int) {
	p.mu.Lock()
	p.held = n
	p.resumeLocked()
	p.mu.Unlock()
}

// finish records that recs are done (effect committed, duplicate, ignored or
// safely copied to .retry/.dlq) and moves the commit mark over the longest
// finished prefix of what was dispatched.
func (p *partition) finish(recs []*kgo.Record) {
	p.mu.Lock()
	defer func() {
		lag, oldest := p.lagLocked()
		p.mu.Unlock()
		p.reportLag(lag, oldest)
	}()
	for _, r := range recs {
		p.finished[r.Offset] = true
	}
	i := 0
	for i < len(p.pending) && p.finished[p.pending[i].offset] {
		delete(p.finished, p.pending[i].offset)
		p.mark = kgo.EpochOffset{Offset: p.pending[i].offset + 1, Epoch: p.pending[i].epoch}
		i++
	}
	p.pending = p.pending[i:]
}

// lagLocked returns the records between the first one not finished and the
// high watermark of the last fetch (those fetched and not yet done, and
// those not fetched yet; -1 when not known: no fetch yet), and the timestamp
// of the first fetched record not finished (zero when none).
func (p *partition) lagLocked() (int64, time.Time) {
	from, oldest := p.mark.Offset, time.Time{}
	if len(p.pending) > 0 {
		from, oldest = p.pending[0].offset, p.pending[0].ts
	}
	if p.hwm < 0 || from < 0 {
		return -1, oldest
	}
	return max(0, p.hwm-from), oldest
}

func (p *partition) reportLag(n int64, oldest time.Time) {
	if n >= 0 {
		p.s.p.Lag(p.topic, p.part, n, oldest)
	}
}

// committable returns the commit mark if it moved since the last commit.
func (p *partition) committable() (kgo.EpochOffset, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mark, p.mark.Offset > p.last
}

func (p *partition) committed(mark kgo.EpochOffset) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.last = max(p.last, mark.Offset)
}

// stop asks the worker to return after the batch in hand.
func (p *partition) stop() { p.quitOnce.Do(func() { close(p.quit) }) }

func (p *partition) stopping() bool {
	select {
	case <-p.quit:
		return true
	default:
		return false
	}
}

func (p *partition) run() {
	defer close(p.done)
	defer p.routing.Wait() // copies in flight are in-flight work too
	if p.retry {
		p.runRetry()
		return
	}
	for !p.stopping() {
		batch := p.take(p.s.set.BatchSize)
		if len(batch) == 0 {
			select {
			case <-p.wake:
			case <-p.quit:
			}
			continue
		}
		items := make([]*item, len(batch))
		for i, r := range batch {
			items[i] = p.item(r, 1)
		}
		if !p.process(items) {
			return
		}
	}
}

// process runs one batch: its records that are done (committed, duplicate,
// ignored) are marked finished at once; its failures are copied to
// .retry/.dlq in the background (route) and marked finished when the broker
// has confirmed the copies, so the next batch does not wait for that round
// trip. The commit mark never passes an unfinished record, so a source
// offset is committed only after its copy is safe. process returns false
// when the consumer is crashing or the batch was abandoned (nothing of it
// gets committed).
func (p *partition) process(items []*item) bool {
	s := p.s
	ds := make([]*transport.Delivery, len(items))
	for i, it := range items {
		ds[i] = it.d
	}
	if s.set.AtMostOnce {
		// At-most-once: the offsets are committed before processing; a crash
		// from here on loses these records.
		recs := make([]*kgo.Record, len(items))
		for i, it := range items {
			recs[i] = it.rec
		}
		p.finish(recs)
		if !s.commitNow(p) {
			return false
		}
	}
	fails, err := s.p.Handle(s.workCtx, &transport.Batch{Deliveries: ds, Stop: p.quit})
	if err != nil {
		return false
	}
	if !s.set.AtMostOnce {
		failed := make(map[*transport.Delivery]bool, len(fails))
		for _, f := range fails {
			failed[f.D] = true
		}
		done := make([]*kgo.Record, 0, len(items))
		for _, it := range items {
			if !failed[it.d] {
				done = append(done, it.rec)
			}
		}
		p.finish(done)
		s.wakeCommitter()
	}
	if len(fails) == 0 {
		return true
	}
	select {
	case p.routes <- struct{}{}: // at most routesPerPartition batches in flight
	case <-s.workCtx.Done():
		return false
	}
	p.routing.Add(1)
	go func() {
		defer func() { <-p.routes; p.routing.Done() }()
		if s.route(p, fails) != nil || s.set.AtMostOnce {
			return
		}
		recs := make([]*kgo.Record, len(fails))
		for i, f := range fails {
			recs[i] = f.D.Ref.(*kgo.Record)
		}
		p.finish(recs)
		s.wakeCommitter()
	}()
	return true
}

// routesPerPartition bounds the batches of one partition whose copies are
// being produced at once; beyond it the worker waits (a broker outage stalls
// the partition instead of piling up work).
const routesPerPartition = 4

// commitNow commits p's mark synchronously, retrying until it succeeds, the
// partition is stopped or the consumer crashes.
func (s *Source) commitNow(p *partition) bool {
	var fails int
	for {
		err := s.commit(s.workCtx, []*partition{p})
		if err == nil {
			return true
		}
		s.log.Warn("consumer: at-most-once commit", "topic", p.topic, "partition", p.part, "err", err)
		if !s.pause(p, &fails) {
			return false
		}
	}
}

// pause counts one more consecutive failure in *fails and waits its backoff
// (50 ms doubling to 5 s, jittered) unless the partition stops or the
// consumer crashes first; it reports whether to carry on.
func (s *Source) pause(p *partition, fails *int) bool {
	*fails++
	return s.sleep(p, pause.Backoff(50*time.Millisecond, 5*time.Second, *fails))
}

// sleep waits d unless the partition stops or the consumer stops or crashes
// first; it reports whether to carry on.
func (s *Source) sleep(p *partition, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return s.workCtx.Err() == nil
	case <-p.quit:
		return false
	case <-s.workCtx.Done():
		return false
	}
}

// runRetry is the worker of a retry partition. Copies are taken off the queue
// at once: copies of another group are finished on the spot, due ones are
// processed, the others wait in a heap ordered by no_abans. The worker sleeps
// on a timer set to the earliest no_abans (or a new fetch), never inside the
// poll loop, and a copy that is due never waits behind one that is not: the
// heap releases them by time, not by offset. The commit mark only moves over
// finished offsets, so an unfinished copy is redelivered after a crash or a
// rebalance.
func (p *partition) runRetry() {
	s := p.s
	var waiting heldHeap
	defer func() { s.p.Held(-len(waiting)) }()
	var timer *time.Timer
	for !p.stopping() {
		var foreign []*kgo.Record
		taken := time.Now()
		for _, r := range p.take(0) {
			it := p.retryItem(r, taken)
			if it == nil {
				foreign = append(foreign, r)
				continue
			}
			heap.Push(&waiting, it)
			s.p.Held(1)
		}
		if len(foreign) > 0 {
			s.p.Foreign(p.source, len(foreign))
			p.finish(foreign)
			s.wakeCommitter()
		}
		now := time.Now()
		var ready []*item
		for len(waiting) > 0 && !waiting[0].notBefore.After(now) && len(ready) < s.set.BatchSize {
			ready = append(ready, heap.Pop(&waiting).(*item))
			s.p.Held(-1)
		}
		p.setHeld(len(waiting))
		if len(ready) > 0 {
			slices.SortFunc(ready, func(a, b *item) int { return cmp.Compare(a.rec.Offset, b.rec.Offset) })
			if !p.process(ready) {
				return
			}
			continue
		}
		var tc <-chan time.Time
		if len(waiting) > 0 {
			if timer == nil {
				timer = time.NewTimer(time.Until(waiting[0].notBefore))
			} else {
				timer.Reset(time.Until(waiting[0].notBefore))
			}
			tc = timer.C
		}
		select {
		case <-p.wake:
		case <-tc:
		case <-p.quit:
		}
	}
}

// item is one record on its way to the pipeline.
type item struct {
	rec       *kgo.Record
	d         *transport.Delivery
	notBefore time.Time // retry copies: no_abans
}

// item returns the item of r, a record of p on its attempt-th attempt.
func (p *partition) item(r *kgo.Record, attempt int) *item {
	d := &transport.Delivery{Message: FromRecord(r), Origin: p.source, Partition: r.Partition, Offset: r.Offset,
		Timestamp: r.Timestamp, Attempt: attempt, Ref: r}
	return &item{rec: r, d: d}
}

// heldHeap orders held retry copies by no_abans, then offset.
type heldHeap []*item

func (h heldHeap) Len() int { return len(h) }
func (h heldHeap) Less(i, j int) bool {
	if !h[i].notBefore.Equal(h[j].notBefore) {
		return h[i].notBefore.Before(h[j].notBefore)
	}
	return h[i].rec.Offset < h[j].rec.Offset
}
func (h heldHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *heldHeap) Push(x any)   { *h = append(*h, x.(*item)) }
func (h *heldHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return x
}
