package kfake

import (
	"context"
	"encoding/binary"
	"hash/crc32"
	"os"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kbin"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/kversion"
)

// From km0 (github.com/km0/km0): after a crash the broker must still know
// each idempotent producer's sequences, from the log.

// km0Batch is a RecordBatch of n empty records from pid/epoch, first
// sequence seq.
func km0Batch(pid int64, epoch int16, seq, n int32) []byte {
	var recs []byte
	for i := range n {
		body := []byte{0}
		body = kbin.AppendVarlong(body, 0)
		body = kbin.AppendVarint(body, i)
		body = kbin.AppendVarint(body, -1)
		body = kbin.AppendVarint(body, 0)
		body = kbin.AppendVarint(body, 0)
		recs = kbin.AppendVarint(recs, int32(len(body)))
		recs = append(recs, body...)
	}
	now := time.Now().UnixMilli()
	b := make([]byte, 61, 61+len(recs))
	binary.BigEndian.PutUint32(b[8:], uint32(49+len(recs)))
	b[16] = 2
	binary.BigEndian.PutUint32(b[23:], uint32(n-1))
	binary.BigEndian.PutUint64(b[27:], uint64(now))
	binary.BigEndian.PutUint64(b[35:], uint64(now))
	binary.BigEndian.PutUint64(b[43:], uint64(pid))
	binary.BigEndian.PutUint16(b[51:], uint16(epoch))
	binary.BigEndian.PutUint32(b[53:], uint32(seq))
	binary.BigEndian.PutUint32(b[57:], uint32(n))
	b = append(b, recs...)
	binary.BigEndian.PutUint32(b[17:], crc32.Checksum(b[21:], crc32.MakeTable(crc32.Castagnoli)))
	return b
}

// TestIdempotentSequencesSurviveACrash: a producer writes seq 0-2 and 3-4;
// the data dir is copied while the cluster runs (the files a SIGKILL leaves:
// no seq_windows.json) and a cluster started on the copy. Expected: seq 10
// (ahead of the log) gets OUT_OF_ORDER_SEQUENCE_NUMBER, seq 3-4 is a
// duplicate at offset 3, seq 5-9 is appended at 5. Without the state rebuilt
// from the log, seq 10 is appended at offset 5: with two requests in flight,
// a later batch is written before an earlier one.
func TestIdempotentSequencesSurviveACrash(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir, crashed := t.TempDir(), t.TempDir()
	start := func(dir string) *kgo.Client {
		c, err := NewCluster(NumBrokers(1), SeedTopics(1, "seq"), DataDir(dir))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.MaxVersions(kversion.V3_6_0()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		return cl
	}
	produce := func(cl *kgo.Client, pid int64, epoch int16, seq, n int32, wantCode int16, wantOff int64) {
		t.Helper()
		req := kmsg.NewPtrProduceRequest()
		req.Acks, req.TimeoutMillis = -1, 10_000
		rt := kmsg.NewProduceRequestTopic()
		rt.Topic = "seq"
		rp := kmsg.NewProduceRequestTopicPartition()
		rp.Records = km0Batch(pid, epoch, seq, n)
		rt.Partitions = append(rt.Partitions, rp)
		req.Topics = append(req.Topics, rt)
		resp, err := req.RequestWith(ctx, cl)
		if err != nil {
			t.Fatal(err)
		}
		p := resp.Topics[0].Partitions[0]
		if p.ErrorCode != wantCode || wantCode == 0 && p.BaseOffset != wantOff {
			t.Fatalf("seq %d-%d: %v at %d, want %v at %d", seq, seq+n-1, kerr.ErrorForCode(p.ErrorCode), p.BaseOffset, kerr.ErrorForCode(wantCode), wantOff)
		}
	}

	cl := start(dir)
	ip, err := kmsg.NewPtrInitProducerIDRequest().RequestWith(ctx, cl)
	if err != nil || ip.ErrorCode != 0 {
		t.Fatalf("init producer id: %v %v", err, kerr.ErrorForCode(ip.ErrorCode))
	}
	pid, epoch := ip.ProducerID, ip.ProducerEpoch
	produce(cl, pid, epoch, 0, 3, 0, 0)
	produce(cl, pid, epoch, 3, 2, 0, 3)
	if err := os.CopyFS(crashed, os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}

	cl = start(crashed)
	produce(cl, pid, epoch, 10, 2, kerr.OutOfOrderSequenceNumber.Code, 0)
	produce(cl, pid, epoch, 3, 2, 0, 3)
	produce(cl, pid, epoch, 5, 5, 0, 5)
	produce(cl, pid, epoch, 10, 2, 0, 10)
}
