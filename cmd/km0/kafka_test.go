package main

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/testkit"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// freeAddr returns a 127.0.0.1 address with a port nobody listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// startKafkaCommand runs `km0 kafka args...` until the returned stop is called
// (what SIGINT/SIGTERM do through main's context) and waits until it answers.
func startKafkaCommand(t *testing.T, addr string, args ...string) (stop func()) {
	t.Helper()
	r := testkit.Start(t, "km0 kafka", func(ctx context.Context) error {
		return runKafka(ctx, append([]string{"--addr", addr}, args...))
	})
	cl, err := kgo.NewClient(kgo.SeedBrokers(addr))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	testkit.Eventuallyf(t, 30*time.Second, "km0 kafka to answer at "+addr, func() (bool, string) {
		select {
		case <-r.Done():
			t.Fatalf("km0 kafka exited: %v", r.Err())
		default:
		}
		pctx, pcancel := context.WithTimeout(context.Background(), time.Second)
		defer pcancel()
		err := cl.Ping(pctx)
		return err == nil, fmt.Sprint(err)
	})
	return func() {
		if err := r.Stop(); err != nil {
			t.Fatalf("km0 kafka: %v", err)
		}
	}
}

// `km0 kafka --data-dir DIR` keeps its topics, records and committed group
// offsets across a clean stop (SIGTERM) and a restart on the same address.
func TestKafkaCommandDataDirSurvivesRestart(t *testing.T) {
	t.Parallel()
	dir, addr := t.TempDir(), freeAddr(t)
	const topic, group, n = "km0.test.persist", "km0-test-group", 50
	ctx := context.Background()

	stop := startKafkaCommand(t, addr, "--data-dir", dir, "--partitions", "3")
	cl, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.RequiredAcks(kgo.AllISRAcks()))
	if err != nil {
		t.Fatal(err)
	}
	adm := kadm.NewClient(cl)
	if _, err := adm.CreateTopics(ctx, 3, -1, nil, topic); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		r := &kgo.Record{Topic: topic, Key: []byte(fmt.Sprint("k", i%7)), Value: []byte(fmt.Sprint(i))}
		if err := cl.ProduceSync(ctx, r).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	commit := kadm.Offsets{}
	ends.Each(func(o kadm.ListedOffset) { commit.AddOffset(o.Topic, o.Partition, o.Offset/2, -1) })
	if err := adm.CommitAllOffsets(ctx, group, commit); err != nil {
		t.Fatal(err)
	}
	// A real group member consumes everything of a second group and commits.
	gc, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.ConsumerGroup(group+"-member"), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.DisableAutoCommit())
	if err != nil {
		t.Fatal(err)
	}
	gctx, gcancel := context.WithTimeout(ctx, 20*time.Second)
	for got := 0; got < n && gctx.Err() == nil; {
		fs := gc.PollFetches(gctx)
		got += fs.NumRecords()
		if err := gc.CommitUncommittedOffsets(gctx); err != nil {
			t.Fatal(err)
		}
	}
	gcancel()
	gc.Close()
	cl.Close()
	stop()

	stop = startKafkaCommand(t, addr, "--data-dir", dir, "--partitions", "3")
	defer stop()
	cl2, err := kgo.NewClient(kgo.SeedBrokers(addr))
	if err != nil {
		t.Fatal(err)
	}
	defer cl2.Close()
	adm2 := kadm.NewClient(cl2)
	ends2, err := adm2.ListEndOffsets(ctx, topic, "comandes.esdeveniments")
	if err != nil {
		t.Fatal(err)
	}
	total, parts := int64(0), 0
	ends2.Each(func(o kadm.ListedOffset) {
		if o.Topic == topic {
			if o.Err != nil {
				t.Errorf("partition %d: %v", o.Partition, o.Err)
			}
			total += o.Offset
			parts++
		}
	})
	if parts != 3 || total != n {
		t.Fatalf("after restart: %d partitions with %d records, want 3 with %d", parts, total, n)
	}
	fetched, err := adm2.FetchOffsets(ctx, group)
	if err != nil {
		t.Fatal(err)
	}
	ends.Each(func(o kadm.ListedOffset) {
		got, ok := fetched.Lookup(o.Topic, o.Partition)
		if !ok || got.At != o.Offset/2 {
			t.Errorf("group offset %s/%d after restart: %v (present %v), want %d", o.Topic, o.Partition, got.At, ok, o.Offset/2)
		}
	})
	member, err := adm2.FetchOffsets(ctx, group+"-member")
	if err != nil {
		t.Fatal(err)
	}
	ends.Each(func(o kadm.ListedOffset) {
		if got, ok := member.Lookup(o.Topic, o.Partition); !ok || got.At != o.Offset {
			t.Errorf("member group offset %s/%d after restart: %v (present %v), want %d", o.Topic, o.Partition, got.At, ok, o.Offset)
		}
	})
	// The records themselves are readable.
	rd, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	seen := map[string]bool{}
	for len(seen) < n && rctx.Err() == nil {
		rd.PollFetches(rctx).EachRecord(func(r *kgo.Record) { seen[string(r.Value)] = true })
	}
	if len(seen) != n {
		t.Fatalf("read back %d distinct records after restart, want %d", len(seen), n)
	}
}

// `km0 kafka --partitions N` with N < 1 is refused, not replaced by 6 while
// the banner repeats the bad number. The context only bounds a hang.
func TestKafkaCommandRefusesBadPartitions(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"0", "-3"} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := runKafka(ctx, []string{"--addr", "127.0.0.1:0", "--partitions", p})
		cancel()
		if err == nil || !strings.Contains(err.Error(), "--partitions") {
			t.Errorf("km0 kafka --partitions %s: want an error naming --partitions, got %v", p, err)
		}
	}
}
