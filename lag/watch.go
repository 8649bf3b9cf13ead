package lag

import (
	"context"
	"sync"
	"time"

	"github.com/km0/km0/dlq"
)

// Rule is when a lag alerts: a value over MaxLag, or an oldest age over
// MaxAge, held for at least For. MaxLag applies to a group's total lag, an
// outbox's pending rows and a queue's ready messages; MaxAge to a group's
// and an outbox's oldest age. A zero threshold is off unless LagSet (AgeSet)
// says it was given: then 0 means zero, "fully caught up".
type Rule struct {
	MaxLag int64
	MaxAge time.Duration
	// LagSet and AgeSet make MaxLag and MaxAge apply even when zero (an
	// operator's --max-lag 0: any lag is over). Default false: a zero
	// threshold is off, so the zero Rule never alerts.
	LagSet, AgeSet bool
	For            time.Duration
	// AllGroups applies the rule to foreign groups too (GroupLag.Foreign).
	// Default false: only the system's groups alert.
	AllGroups bool
}

// lagOn reports whether MaxLag applies.
func (r Rule) lagOn() bool { return r.LagSet || r.MaxLag > 0 }

// ageOn reports whether MaxAge applies.
func (r Rule) ageOn() bool { return r.AgeSet || r.MaxAge > 0 }

// On reports whether the rule checks anything.
func (r Rule) On() bool { return r.lagOn() || r.ageOn() }

// Over reports whether lag is over MaxLag and whether oldest (seconds; only
// when hasAge) is over MaxAge.
func (r Rule) Over(lag int64, oldest float64, hasAge bool) (lagOver, ageOver bool) {
	return r.lagOn() && lag > r.MaxLag, hasAge && r.ageOn() && oldest > r.MaxAge.Seconds()
}

// Watch turns snapshots into lag alerts through a dlq.Alerter (its log and
// webhook): an "alerta" notice once an object has been over the Rule for
// Rule.For, and a "resolta" notice when it is back under. An object that
// disappears from the snapshots (or fails to be measured) keeps its state.
// Safe for concurrent use.
type Watch struct {
	rule    Rule
	alerter *dlq.Alerter

	mu    sync.Mutex
	state map[string]*overState
}

type overState struct {
	since time.Time
	fired bool
}

// NewWatch returns a Watch of rule that alerts through a.
func NewWatch(rule Rule, a *dlq.Alerter) *Watch {
	return &Watch{rule: rule, alerter: a, state: map[string]*overState{}}
}

// Evaluate checks every object of snap at snap.At.
func (w *Watch) Evaluate(ctx context.Context, snap *Snapshot) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, g := range snap.Groups {
		if g.Err == "" && (!g.Foreign || w.rule.AllGroups) {
			w.check(ctx, "grup "+g.Group, g.Total, g.OldestSeconds, true, snap.At)
		}
	}
	for _, o := range snap.Outboxes {
		if o.Err == "" {
			w.check(ctx, "outbox "+o.Name, o.Pending, o.OldestSeconds, true, snap.At)
		}
	}
	for _, q := range snap.Queues {
		if q.Err == "" {
			w.check(ctx, "cua "+q.Queue, int64(q.Ready), 0, false, snap.At)
		}
	}
}

func (w *Watch) check(ctx context.Context, obj string, lag int64, oldest float64, hasAge bool, now time.Time) {
	lagOver, ageOver := w.rule.Over(lag, oldest, hasAge)
	over := lagOver || ageOver
	st := w.state[obj]
	n := dlq.LagNotice{Objecte: obj, Lag: lag, OldestSeconds: oldest, MaxLag: w.rule.MaxLag,
		MaxAgeSeconds: w.rule.MaxAge.Seconds(), At: now}
	switch {
	case over && st == nil:
		st = &overState{since: now}
		w.state[obj] = st
		fallthrough
	case over && !st.fired:
		if now.Sub(st.since) >= w.rule.For {
			st.fired = true
			n.Estat, n.Since = "alerta", st.since
			w.alerter.Lag(ctx, n)
		}
	case !over && st != nil:
		if st.fired {
			n.Estat, n.Since = "resolta", st.since
			w.alerter.Lag(ctx, n)
		}
		delete(w.state, obj)
	}
}

// Firing returns the objects whose alert is raised now.
func (w *Watch) Firing() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for k, st := range w.state {
		if st.fired {
			out = append(out, k)
		}
	}
	return out
}
