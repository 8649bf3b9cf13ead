package console

import (
	"context"

	"github.com/km0/km0/dlq"
)

// Duplicate letters. After a crash both retry copies of one message can
// reach the restarted consumer, which then dead-letters the same event twice:
// two letters of one event and one consumer. The group page folds them into
// one row (dlq.Filter.Fold, as `km0 dlq ls`) that shows the newest copy and
// how many there are, and a row stands for all its copies:
//
//   - a replay replays one copy of each event and consumer (the consumer gets
//     the event once; one is enough) and marks its other pending copies
//     purged when the operator confirms, so no copy is left pending to be
//     replayed again;
//   - a purge purges every copy.
//
// The dry run or confirm page lists the copies, and its plan binds them: the
// action acts on exactly those letters.

// copyKey is what folds letters into one row: their event and consumer.
type copyKey struct{ event, group string }

// groupFilter is the filter of the page a selection was made on: the
// group's topic, class and narrowing (the form of ticked letters carries
// them too), so that copies are looked for among the letters that page
// folded.
func (s selection) groupFilter() dlq.Filter {
	f := dlq.Filter{Topic: s.Topic, Class: s.Class}
	s.N.apply(&f)
	return f
}

// copiesOf returns the IDs of the letters in states that the page of sel
// folds with a letter of keys (the same event and consumer), but those in
// own, in the index's order. Letters without an id_esdeveniment have no
// copies.
func (c *Console) copiesOf(ctx context.Context, sel selection, keys map[copyKey]bool, own []string, states ...dlq.State) ([]string, error) {
	seen := map[string]bool{}
	var events []string
	for k := range keys {
		if k.event != "" && !seen[k.event] {
			seen[k.event] = true
			events = append(events, k.event)
		}
	}
	if len(events) == 0 {
		return nil, nil
	}
	f := sel.groupFilter()
	f.EventIDs, f.States = events, states
	ls, err := c.cfg.Source.List(ctx, f)
	if err != nil {
		return nil, err
	}
	mine := map[string]bool{}
	for _, id := range own {
		mine[id] = true
	}
	var out []string
	for _, l := range ls.Letters {
		if keys[copyKey{l.EventID, l.ConsumerGroup}] && !mine[l.ID] {
			out = append(out, l.ID)
		}
	}
	return out, nil
}

// foldReplay is the plan of a replay from its dry run rep: of the letters
// the dry run would replay, one per event and consumer (the last in DLQ
// order, normally the newest), and the other pending copies of those events
// in sel's page, to mark purged when the replay is confirmed.
func (c *Console) foldReplay(ctx context.Context, sel selection, rep *dlq.Report) (ids, copies []string, err error) {
	kept := map[copyKey]string{}
	for _, it := range rep.Items {
		if it.Done && it.EventID != "" {
			kept[copyKey{it.EventID, it.Group}] = it.ID
		}
	}
	keys := map[copyKey]bool{}
	for k := range kept {
		keys[k] = true
	}
	for _, it := range rep.Items {
		if it.Done && (it.EventID == "" || kept[copyKey{it.EventID, it.Group}] == it.ID) {
			ids = append(ids, it.ID)
		}
	}
	copies, err = c.copiesOf(ctx, sel, keys, ids, dlq.StatePending)
	return ids, copies, err
}

// purgeCopies is, for a purge of ticked letters, the other copies of each
// (pending or replayed) in the page they were ticked on: a row stands for
// all its copies.
func (c *Console) purgeCopies(ctx context.Context, sel selection, ids []string) ([]string, error) {
	if sel.Scope != "seleccio" || len(ids) == 0 {
		return nil, nil // a group or filter purge selects every copy already
	}
	ls, err := c.cfg.Source.List(ctx, dlq.Filter{IDs: ids})
	if err != nil {
		return nil, err
	}
	keys := map[copyKey]bool{}
	for _, l := range ls.Letters {
		keys[copyKey{l.EventID, l.ConsumerGroup}] = true
	}
	return c.copiesOf(ctx, sel, keys, ids, dlq.StatePending, dlq.StateReplayed)
}
