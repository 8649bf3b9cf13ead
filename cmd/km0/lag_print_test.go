package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/km0/km0/lag"
)

// lagSample is a snapshot with an outbox, a group behind on its topic and
// caught up on eight partitions of its .retry topic, a group that could
// not be described, and a queue without the management API.
func lagSample() *lag.Snapshot {
	g := lag.GroupLag{Group: "inventari.descompte_estoc", State: "Stable", Members: 1, Total: 3, OldestSeconds: 75,
		Partitions: []lag.PartitionLag{
			{Topic: "comandes.esdeveniments", Partition: 0, Committed: 2, End: 5, Lag: 3, OldestSeconds: 75},
			{Topic: "comandes.esdeveniments", Partition: 1, Committed: -1, End: 0},
		}}
	for p := range int32(8) {
		g.Partitions = append(g.Partitions, lag.PartitionLag{Topic: "comandes.esdeveniments.retry", Partition: p, Committed: -1})
	}
	return &lag.Snapshot{
		Outboxes: []lag.OutboxLag{{Name: "comandes", Pending: 2, OldestSeconds: 90}},
		Groups:   []lag.GroupLag{g, {Group: "repartiment.assignacio", Err: "cannot be described"}},
		Queues:   []lag.QueueLag{{Queue: "repartiment.assignacio.3", Ready: 4, Unacked: -1, Consumers: 1}},
		Notes:    []string{lag.NoteNoManagement},
	}
}

// km0 lag prints one line per group by default; --partitions a line per
// partition, the caught-up partitions of a .retry topic in one line; never
// a Go slice or map.
func TestLagOutput(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	printLag(&b, lagSample(), false)
	want := `OUTBOX    PENDING  OLDEST
comandes  2        1m30s

GROUP                      STATE   MEMBERS  PARTITIONS  LAG  OLDEST
inventari.descompte_estoc  Stable  1        10          3    1m15s
repartiment.assignacio     error: cannot be described

QUEUE                     READY  UNACKED  CONSUMERS
repartiment.assignacio.3  4      -        1
note: ` + lag.NoteNoManagement + "\n"
	if got := b.String(); got != want {
		t.Fatalf("km0 lag:\n%s\nwant:\n%s", got, want)
	}
	b.Reset()
	printLag(&b, lagSample(), true)
	want = `OUTBOX    PENDING  OLDEST
comandes  2        1m30s

GROUP                      TOPIC                         PARTITION     COMMITTED  END  LAG  OLDEST
inventari.descompte_estoc  comandes.esdeveniments        0             2          5    3    1m15s
inventari.descompte_estoc  comandes.esdeveniments        1             -          0    0    -
inventari.descompte_estoc  comandes.esdeveniments.retry  8 partitions                  0    -
inventari.descompte_estoc  total (Stable, 1 member)                                    3    1m15s
repartiment.assignacio     error: cannot be described

QUEUE                     READY  UNACKED  CONSUMERS
repartiment.assignacio.3  4      -        1
note: ` + lag.NoteNoManagement + "\n"
	if got := b.String(); got != want {
		t.Fatalf("km0 lag --partitions:\n%s\nwant:\n%s", got, want)
	}
	if strings.ContainsAny(b.String(), "[]{}") {
		t.Fatalf("km0 lag --partitions prints a Go value:\n%s", b.String())
	}
}

// A WAL-mode outbox shows its slot: the unconfirmed bytes as pending, the
// oldest unconfirmed message's age (? when a relay streams from the slot),
// the retained WAL and the slot's status, beside a table outbox.
func TestLagOutputWAL(t *testing.T) {
	t.Parallel()
	s := &lag.Snapshot{Outboxes: []lag.OutboxLag{
		{Name: "comandes", Pending: 2, OldestSeconds: 90},
		{Name: "repartiment", Err: "its database does not answer"},
		{Name: "pagaments", OldestSeconds: 3600, WAL: &lag.SlotLag{Slot: "km0_wal_pagaments_public_outbox", LagBytes: 592,
			RetainedBytes: 3 << 20, WALStatus: "reserved", OldestKnown: true}},
		{Name: "inventari", WAL: &lag.SlotLag{Slot: "km0_wal_inventari_public_outbox", LagBytes: 12800, RetainedBytes: 13000,
			WALStatus: "reserved", Active: true}},
	}}
	var b bytes.Buffer
	printLag(&b, s, false)
	want := `OUTBOX       MODE   PENDING   OLDEST  SLOT                             RETAINED  STATUS
comandes     table  2         1m30s   -                                -         -
pagaments    wal    592 B     1h0m0s  km0_wal_pagaments_public_outbox  3.0 MiB   reserved, no relay
inventari    wal    12.5 KiB  ?       km0_wal_inventari_public_outbox  12.7 KiB  reserved, streaming
repartiment  error: its database does not answer

`
	if got := b.String(); got != want {
		t.Fatalf("km0 lag:\n%s\nwant:\n%s", got, want)
	}
}
