package kafka_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kbin"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/kversion"

	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// brokerRoleEnv makes the test binary run as `km0 kafka --data-dir`: the
// broker of TestEmbeddedKeepsProducerSequencesAcrossASIGKILL, in a process of
// its own so that it can be SIGKILLed.
const brokerRoleEnv = "KM0_KAFKA_TEST_BROKER"

func TestMain(m *testing.M) {
	if os.Getenv(brokerRoleEnv) == "" {
		os.Exit(m.Run())
	}
	// Child: serve until stdin closes (the parent closed it, or died).
	addr, dir := os.Getenv(brokerRoleEnv+"_ADDR"), os.Getenv(brokerRoleEnv+"_DATA")
	b, err := kafkaembed.Start(kafkaembed.Config{Addr: addr, DataDir: dir, Partitions: 1, Topics: []string{seqTopic}})
	if err != nil {
		fmt.Fprintln(os.Stderr, "broker:", err)
		os.Exit(1)
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	b.Close()
	os.Exit(0)
}

const seqTopic = "seq"

// brokerProc is the broker child process.
type brokerProc struct {
	cmd   *exec.Cmd
	stdin io.Closer
	done  chan struct{}
}

func startBrokerProc(t *testing.T, addr, dir string) *brokerProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), brokerRoleEnv+"=1", brokerRoleEnv+"_ADDR="+addr, brokerRoleEnv+"_DATA="+dir)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &brokerProc{cmd: cmd, stdin: stdin, done: make(chan struct{})}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "ready" {
				close(ready)
			}
		}
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(p.kill)
	select {
	case <-ready:
	case <-p.done:
		t.Fatalf("broker exited before it was ready: %s", stderr.String())
	case <-time.After(60 * time.Second):
		t.Fatal("broker not ready within 60 s")
	}
	return p
}

// stop shuts the broker down cleanly (it saves its state) and waits for it.
func (p *brokerProc) stop() {
	_ = p.stdin.Close()
	<-p.done
}

// kill SIGKILLs the broker and waits for it to be gone.
func (p *brokerProc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// idempotentBatch is a RecordBatch of n records from producer pid/epoch whose
// first sequence number is seq.
func idempotentBatch(pid int64, epoch int16, seq, n int32) []byte {
	var recs []byte
	for i := range n {
		var body []byte
		body = append(body, 0)             // attributes
		body = kbin.AppendVarlong(body, 0) // timestamp delta
		body = kbin.AppendVarint(body, i)  // offset delta
		body = kbin.AppendVarint(body, -1) // no key
		v := fmt.Sprintf("seq %d", seq+i)  //
		body = kbin.AppendVarint(body, int32(len(v)))
		body = append(body, v...)
		body = kbin.AppendVarint(body, 0) // no headers
		recs = kbin.AppendVarint(recs, int32(len(body)))
		recs = append(recs, body...)
	}
	now := time.Now().UnixMilli()
	b := make([]byte, 61, 61+len(recs))
	binary.BigEndian.PutUint32(b[8:], uint32(49+len(recs))) // length: from leader epoch on
	b[16] = 2                                               // magic
	binary.BigEndian.PutUint32(b[23:], uint32(n-1))         // last offset delta
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

// TestEmbeddedKeepsProducerSequencesAcrossASIGKILL: an idempotent producer
// writes to `km0 kafka --data-dir`, the broker is SIGKILLed and restarted on
// the same data dir. A batch that skips ahead of the log (as when the batch
// before it failed while both were in flight) must get
// OUT_OF_ORDER_SEQUENCE_NUMBER, a batch already in the log must be answered
// as the duplicate it is with its first offset, and the next batch in
// sequence must be appended, then the skipped-ahead one after it. A broker
// that lost its producer state accepts the later batch first: that put a
// later chunk of an aggregate's events ahead of an earlier one on the topic
// (the earlier one got OUT_OF_ORDER_SEQUENCE_NUMBER, the client bumped its
// epoch and wrote both again). The second round restarts the broker cleanly
// first, so that the SIGKILL leaves a stale seq_windows.json behind.
func TestEmbeddedKeepsProducerSequencesAcrossASIGKILL(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	dir := t.TempDir()
	newClient := func() *kgo.Client {
		cl, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.MaxVersions(kversion.V3_6_0())) // produce v9: topics by name
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		return cl
	}
	produce := func(cl *kgo.Client, pid int64, epoch int16, seq, n int32) (int16, int64) {
		t.Helper()
		req := kmsg.NewPtrProduceRequest()
		req.Acks, req.TimeoutMillis = -1, 10_000
		rt := kmsg.NewProduceRequestTopic()
		rt.Topic = seqTopic
		rp := kmsg.NewProduceRequestTopicPartition()
		rp.Records = idempotentBatch(pid, epoch, seq, n)
		rt.Partitions = append(rt.Partitions, rp)
		req.Topics = append(req.Topics, rt)
		resp, err := req.RequestWith(ctx, cl)
		if err != nil {
			t.Fatalf("produce seq %d: %v", seq, err)
		}
		p := resp.Topics[0].Partitions[0]
		return p.ErrorCode, p.BaseOffset
	}
	want := func(what string, code int16, off int64, wantCode int16, wantOff int64) {
		t.Helper()
		if code != wantCode || code == 0 && off != wantOff {
			t.Fatalf("%s: %v at offset %d, want %v at offset %d", what, kerr.ErrorForCode(code), off, kerr.ErrorForCode(wantCode), wantOff)
		}
	}

	broker := startBrokerProc(t, addr, dir)
	cl := newClient()
	ip, err := kmsg.NewPtrInitProducerIDRequest().RequestWith(ctx, cl)
	if err != nil || ip.ErrorCode != 0 {
		t.Fatalf("init producer id: %v %v", err, kerr.ErrorForCode(ip.ErrorCode))
	}
	pid, epoch := ip.ProducerID, ip.ProducerEpoch
	c, off := produce(cl, pid, epoch, 0, 3)
	want("seq 0-2", c, off, 0, 0)
	c, off = produce(cl, pid, epoch, 3, 2)
	want("seq 3-4", c, off, 0, 3)

	broker.kill()
	broker = startBrokerProc(t, addr, dir)
	cl = newClient()

	c, off = produce(cl, pid, epoch, 10, 2)
	want("seq 10-11 before 5-9, after the restart", c, off, kerr.OutOfOrderSequenceNumber.Code, 0)
	c, off = produce(cl, pid, epoch, 3, 2)
	want("seq 3-4 again (a duplicate)", c, off, 0, 3)
	c, off = produce(cl, pid, epoch, 5, 5)
	want("seq 5-9", c, off, 0, 5)
	c, off = produce(cl, pid, epoch, 10, 2)
	want("seq 10-11", c, off, 0, 10)

	// A clean restart saves the windows (next: 12); a batch and a SIGKILL
	// make that file stale (next: 14).
	broker.stop()
	broker = startBrokerProc(t, addr, dir)
	cl = newClient()
	c, off = produce(cl, pid, epoch, 12, 2)
	want("seq 12-13, after a clean restart", c, off, 0, 12)
	broker.kill()
	startBrokerProc(t, addr, dir)
	cl = newClient()
	c, off = produce(cl, pid, epoch, 16, 1)
	want("seq 16 before 14-15, after the second restart", c, off, kerr.OutOfOrderSequenceNumber.Code, 0)
	c, off = produce(cl, pid, epoch, 12, 2)
	want("seq 12-13 again (a duplicate)", c, off, 0, 12)
	c, off = produce(cl, pid, epoch, 14, 2)
	want("seq 14-15", c, off, 0, 14)
}

// TestPublisherKeepsKeyOrderAcrossBrokerSIGKILLs: km0's Publisher (franz-go's
// idempotent producer, km0's options) writes one key's ordered stream while
// the broker process is SIGKILLed and restarted on its data dir between
// publications; the client is left alone during the outage, so its produce
// connection to the dead process is stale when the next Publish starts. That
// Publish's first batch can go out on the stale connection and fail while the
// next one, pipelined behind it (the partition had good answers before), goes
// on a new connection to the restarted broker. Every record must be on the
// topic, and first occurrences in publication order. On the pristine kfake
// (no producer state after the SIGKILL) it failed 6 runs out of 6, with 164
// to 563 of 3,601 records first seen out of order and 40 to 337 copies.
func TestPublisherKeepsKeyOrderAcrossBrokerSIGKILLs(t *testing.T) {
	t.Parallel()
	const rounds, perRound = 12, 300
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	dir := t.TempDir()
	broker := startBrokerProc(t, addr, dir)
	cl, err := kafka.NewClient([]string{addr})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	pub := kafka.NewPublisher(cl)
	next := 0
	publish := func(n int) {
		t.Helper()
		msgs := make([]*transport.Message, n)
		for i := range msgs {
			msgs[i] = &transport.Message{Topic: seqTopic, Key: []byte("k"), Value: []byte(strconv.Itoa(next))}
			next++
		}
		if err := pub.Publish(ctx, msgs); err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
	publish(1)
	for range rounds {
		broker.kill()
		broker = startBrokerProc(t, addr, dir)
		publish(perRound)
	}

	rd, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{
		seqTopic: {0: kgo.NewOffset().AtStart()}}))
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	seen := make(map[int]bool)
	maxSeen, total, outOfOrder := -1, 0, 0
	for len(seen) < next {
		fs := rd.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read %d of %d distinct records: %v", len(seen), next, err)
		}
		fs.EachRecord(func(r *kgo.Record) {
			total++
			v, _ := strconv.Atoi(string(r.Value))
			if seen[v] {
				return
			}
			seen[v] = true
			if v < maxSeen {
				outOfOrder++
				if outOfOrder <= 3 {
					t.Errorf("record %d first seen at offset %d, after record %d", v, r.Offset, maxSeen)
				}
			}
			maxSeen = max(maxSeen, v)
		})
	}
	t.Logf("%d records published, %d on the topic, %d first seen out of order", next, total, outOfOrder)
}
