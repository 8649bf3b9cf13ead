package kfake

import (
	"math"
	"time"
)

// km0: idempotent producer state rebuilt from the log at load.
//
// The sequence windows are saved to seq_windows.json only at an orderly
// shutdown. After a crash (SIGKILL, power loss) the file is missing or stale,
// so a restarted broker used to hold no sequence state for producers that
// wrote since: it accepted any first sequence from them. With several produce
// requests in flight for one partition, a later batch could then be appended
// before an earlier one, which got OUT_OF_ORDER_SEQUENCE_NUMBER afterwards;
// the client bumped its epoch and produced both again, leaving the later
// batch in the log twice, once ahead of the batch it follows. Kafka rebuilds
// producer state from the log (its snapshots are only a shortcut); so does
// this: the log's batches are the truth, and the windows they give replace
// what seq_windows.json says for the same producer and partition.

// logSeqWindow is a producer's sequence window on one partition as its last
// batches in the log give it.
type logSeqWindow struct {
	epoch int16
	win   pidwindow
}

// seqWindowsFromLog returns, per producer ID, the window of its last (up to
// five) data batches of its last epoch in batches (in log order). Control
// batches and batches without a sequence are skipped.
func seqWindowsFromLog(batches []*partBatch) map[int64]*logSeqWindow {
	var out map[int64]*logSeqWindow
	for _, b := range batches {
		if b.ProducerID < 0 || b.FirstSequence < 0 || b.Attributes&0x0020 != 0 {
			continue
		}
		if out == nil {
			out = make(map[int64]*logSeqWindow)
		}
		w := out[b.ProducerID]
		if w == nil || w.epoch != b.ProducerEpoch {
			w = &logSeqWindow{epoch: b.ProducerEpoch, win: pidwindow{seen: true, epoch: b.ProducerEpoch}}
			out[b.ProducerID] = w
		}
		next := int32((int64(b.FirstSequence) + int64(b.NumRecords)) % math.MaxInt32)
		pw := &w.win
		pw.entries[pw.at] = pidEntry{firstSeq: b.FirstSequence, nextSeq: next, offset: b.FirstOffset}
		pw.at = (pw.at + 1) % 5
		if pw.count < 5 {
			pw.count++
		}
		pw.nextSeq = next
	}
	return out
}

// applySeqWindowsFromLog installs the windows the partitions' logs gave at
// load (after pids.log and seq_windows.json are read), creating the state of
// a non-transactional producer the broker has no record of, as the first
// produce from it would. A producer's epoch is raised to the log's when the
// log holds a later one (a client-side bump, KIP-360).
func (c *Cluster) applySeqWindowsFromLog() {
	c.data.tps.each(func(t string, p int32, pd *partData) {
		for pid, w := range pd.logSeqWindows {
			pidinf := c.pids.ids[pid]
			if pidinf == nil {
				pidinf = &pidinfo{pids: &c.pids, id: pid, epoch: w.epoch, lastActive: time.Now()}
				c.pids.ids[pid] = pidinf
			}
			if pidinf.txid == "" && w.epoch > pidinf.epoch {
				pidinf.epoch = w.epoch
			}
			pidinf.windows.set(t, p, w.win)
		}
		pd.logSeqWindows = nil
	})
}
