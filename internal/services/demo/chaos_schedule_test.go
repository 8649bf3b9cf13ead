package demo

import (
	"reflect"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/system"
)

// The schedule of a chaos run comes from its seed alone: --seed replays it.
// With 15 kills every service is killed at least twice, every fault falls
// within the drive, and each poison batch holds every kind of poison record.
func TestChaosScheduleIsDrawnFromTheSeed(t *testing.T) {
	a := makeSchedule(42, 15, 150*time.Second, 10*time.Second, true)
	if b := makeSchedule(42, 15, 150*time.Second, 10*time.Second, true); !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed gave two schedules")
	}
	if c := makeSchedule(43, 15, 150*time.Second, 10*time.Second, true); reflect.DeepEqual(a, c) {
		t.Fatal("two seeds gave the same schedule")
	}
	kinds, targets := map[string]int{}, map[string]int{}
	for i, f := range a {
		kinds[f.Kind]++
		if f.Kind == FaultKill {
			targets[f.Target]++
		}
		if f.At <= 0 || f.At >= 150*time.Second || (i > 0 && f.At < a[i-1].At) {
			t.Errorf("fault %d at %v: outside the drive or out of order", i, f.At)
		}
		if f.Kind == FaultBroker && f.Down != 10*time.Second {
			t.Errorf("broker down %v", f.Down)
		}
	}
	if kinds[FaultKill] != 15 || kinds[FaultBroker] != 1 || kinds[FaultPGFast] != 1 || kinds[FaultPGImmediate] != 1 || kinds[FaultPoison] != PoisonBatches {
		t.Errorf("kinds %v", kinds)
	}
	for _, s := range system.Services {
		if targets[s] < 2 {
			t.Errorf("%s killed %d times, want at least 2 of 15", s, targets[s])
		}
	}
	if n := makeSchedule(1, 0, time.Minute, 0, false); len(n) != PoisonBatches {
		t.Errorf("no kills, no broker, no own PostgreSQL: %d faults, want only the %d poison batches", len(n), PoisonBatches)
	}
	batch := poisonBatch(0)
	if len(batch) != poisonPerBatch {
		t.Fatalf("poison batch of %d, poisonPerBatch %d", len(batch), poisonPerBatch)
	}
	big := 0
	for _, p := range batch {
		if p.Bytes > 800_000 && p.Bytes < 1_000_000 {
			big++
		}
		if len(p.Expect) != len(topicGroups[p.Topic]) {
			t.Errorf("%s: expectations for %d groups, the topic has %d", p.Name, len(p.Expect), len(topicGroups[p.Topic]))
		}
	}
	if big != 1 {
		t.Errorf("%d poison records of about 900 KB, want 1", big)
	}
}
