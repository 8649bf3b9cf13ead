package dlq

import (
	"context"
	"fmt"
	"time"
)

// WatchDefault is how long `km0 dlq sequence --replay` and `km0 dlq replay
// --watch` watch a replay for a new dead letter by default.
const WatchDefault = 10 * time.Second

// Take is the fate of one replayed letter as Watch saw it.
type Take struct {
	ID      string `json:"id"`              // the replayed letter
	EventID string `json:"id_esdeveniment"` // its event
	Group   string `json:"grup_consumidor,omitempty"`
	// Took is false when the same consumer dead-lettered the event again
	// after the replay; then Again is the new letter and Reason its motiu.
	Took   bool   `json:"ha_pres"`
	Again  string `json:"carta_nova,omitempty"`
	Reason string `json:"motiu,omitempty"`
}

// String says it for people: "did not take: dead-lettered again: <motiu>".
func (t Take) String() string {
	if t.Took {
		return "no new dead letter"
	}
	return "did not take: dead-lettered again: " + Safe(t.Reason) + " (letter " + Safe(t.Again) + ")"
}

// Watch watches the letters the reports replayed for within: it syncs the
// index every poll (default 200 ms) and reports, per replayed letter, whether
// a new letter of the same event and consumer died at or after its report's
// Started. It
// returns as soon as every replayed letter dead-lettered again, or when within
// has passed: a letter with no new dead letter by then is reported as taken,
// which for a transient failure still in its retries may not be final. A
// failed Sync is retried until the deadline; the error is returned with
// what was seen if none succeeded.
func (s *Service) Watch(ctx context.Context, within, poll time.Duration, reps ...*Report) ([]Take, error) {
	if poll <= 0 {
		poll = 200 * time.Millisecond
	}
	var takes []Take
	var events, replayed []string
	var started time.Time
	for _, rep := range reps {
		if rep == nil || rep.DryRun {
			continue
		}
		for _, it := range rep.replayed {
			if it.EventID != "" {
				takes = append(takes, Take{ID: it.ID, EventID: it.EventID, Group: it.Group, Took: true})
				events = append(events, it.EventID)
				replayed = append(replayed, it.ID)
			}
		}
		if started.IsZero() || rep.Started.Before(started) {
			started = rep.Started
		}
	}
	if len(takes) == 0 {
		return takes, nil
	}
	deadline := time.Now().Add(within)
	var lastErr error
	synced := false
	for {
		if _, err := s.Sync(ctx); err != nil {
			lastErr = err
		} else {
			synced = true
		}
		f := Filter{EventIDs: events, Since: started, exclude: replayed}
		found, err := s.cfg.Store.listColumns(ctx, s.cfg.Store.db, idColumns, f, byDeadTime, "")
		if err != nil {
			return takes, err
		}
		ls := letters(found)
		left := 0
		for i := range takes {
			t := &takes[i]
			for _, l := range ls.lettersOf(t) {
				t.Took, t.Again, t.Reason = false, l.ID, l.Reason
			}
			if t.Took {
				left++
			}
		}
		if left == 0 || !time.Now().Before(deadline) {
			if !synced && lastErr != nil {
				return takes, fmt.Errorf("dlq: watch: the index could not be brought up to date: %w", lastErr)
			}
			return takes, nil
		}
		t := time.NewTimer(min(poll, time.Until(deadline)))
		select {
		case <-ctx.Done():
			t.Stop()
			return takes, ctx.Err()
		case <-t.C:
		}
	}
}

// letters is what Watch lists: the new letters of the replayed events.
type letters []*Letter

// lettersOf returns the letters of t's event and consumer, oldest first.
func (ls letters) lettersOf(t *Take) []*Letter {
	var out []*Letter
	for _, l := range ls {
		if l.EventID == t.EventID && l.ConsumerGroup == t.Group {
			out = append(out, l)
		}
	}
	return out
}
