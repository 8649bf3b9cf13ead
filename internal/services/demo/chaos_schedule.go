package demo

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"time"

	"github.com/km0/km0/internal/services/system"
)

// Kinds of fault in a chaos schedule.
const (
	FaultKill        = "sigkill"            // SIGKILL a service, restart it after Down
	FaultBroker      = "broker"             // SIGKILL the broker, restart it with the same --data-dir after Down
	FaultPGFast      = "postgres-fast"      // pg_ctl restart -m fast
	FaultPGImmediate = "postgres-immediate" // pg_ctl restart -m immediate
	FaultPoison      = "poison"             // produce a batch of poison records straight to the topics
)

// Fault is one planned fault of a chaos run.
type Fault struct {
	At     time.Duration `json:"at"`               // from the start of the drive
	Kind   string        `json:"kind"`             // one of the Fault* kinds
	Target string        `json:"target,omitempty"` // service name for FaultKill
	Down   time.Duration `json:"down,omitempty"`   // how long the target stays down
}

func (f Fault) String() string {
	switch f.Kind {
	case FaultKill, FaultBroker:
		t := f.Target
		if f.Kind == FaultBroker {
			t = "kafka"
		}
		return fmt.Sprintf("SIGKILL %s (down %.1fs)", t, f.Down.Seconds())
	case FaultPGFast:
		return "PostgreSQL restart -m fast"
	case FaultPGImmediate:
		return "PostgreSQL restart -m immediate"
	}
	return "poison records"
}

// PoisonBatches is how many batches of poison records a run produces.
const PoisonBatches = 3

// makeSchedule draws the faults of a run from seed: kills SIGKILLs of
// services at random moments within the first 85% of duration (every
// service at least once when kills >= 6), each down for 0–3 s; one broker
// outage of brokerDown; with ownPG, a PostgreSQL restart -m fast and one -m
// immediate; and PoisonBatches batches of poison records, all while orders
// still flow. The same seed gives the same schedule.
func makeSchedule(seed uint64, kills int, duration, brokerDown time.Duration, ownPG bool) []Fault {
	rng := rand.New(rand.NewPCG(seed, 0x63686130))
	at := func(lo, hi float64) time.Duration {
		return time.Duration((lo + rng.Float64()*(hi-lo)) * float64(duration))
	}
	var out []Fault
	targets := make([]string, 0, kills)
	for len(targets) < kills {
		perm := rng.Perm(len(system.Services))
		for _, i := range perm {
			if len(targets) < kills {
				targets = append(targets, system.Services[i])
			}
		}
	}
	for _, t := range targets {
		out = append(out, Fault{At: at(0.05, 0.85), Kind: FaultKill, Target: t, Down: time.Duration(rng.IntN(3000)) * time.Millisecond})
	}
	if brokerDown > 0 {
		out = append(out, Fault{At: at(0.30, 0.60), Kind: FaultBroker, Down: brokerDown})
	}
	if ownPG {
		out = append(out, Fault{At: at(0.15, 0.35), Kind: FaultPGFast}, Fault{At: at(0.60, 0.80), Kind: FaultPGImmediate})
	}
	for i := range PoisonBatches {
		lo := 0.1 + 0.6*float64(i)/PoisonBatches
		out = append(out, Fault{At: at(lo, lo+0.1), Kind: FaultPoison})
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].At < out[j].At })
	return out
}
