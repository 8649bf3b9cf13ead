package console

import (
	"context"
	"errors"
	"net/http"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/keyorder"
)

// maxSequenceKeys caps the blocked keys one replay of every sequence of a
// consumer acts on; the confirm page says when there are more.
const maxSequenceKeys = 1000

// keysShown caps the keys the confirm page names.
const keysShown = 50

// sequenceOutcome is one key of the result of replaySequences.
type sequenceOutcome struct {
	Key, Head string // the key, the head's replayed (or refused) letter
	Replayed  bool   // the head went back to its topic
	Refused   string // why not, for people
	Take      *dlq.Take
}

// replaySequences is the per-consumer action of the blocked keys page: it
// replays every blocked sequence of a consumer of a service at once, each as
// one (dlq.ReplaySequences, as `km0 dlq sequence --replay` without --key).
// Without confirmo it lists the consumer's blocked keys and asks to confirm
// (the confirm step, bound to those keys by a plan); with confirmo=1 and the
// plan it replays the keys the page listed that are still blocked, watches
// the replayed heads for Config.ReplayWatch, and shows how many were
// replayed, which did not take (dead-lettered again) and which were refused.
func (c *Console) replaySequences(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	service, err0 := text(r.PostFormValue("servei"))
	consumer, err1 := text(r.PostFormValue("consumidor"))
	if err0 != nil || err1 != nil || consumer == "" {
		c.errorPage(w, r, http.StatusBadRequest, "a replay of every blocked sequence needs consumidor")
		return
	}
	sdb, ok := c.serviceDB(service)
	if !ok {
		c.errorPage(w, r, http.StatusNotFound, "this console shows no per-key order sequences of that service")
		return
	}
	ko, err := keyorder.New(keyorder.Config{Schema: sdb.Schema})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
	defer cancel()
	target := cmpName(service) + " · " + consumer
	view := map[string]any{"Service": service, "Consumer": dlq.Safe(consumer), "Watch": c.cfg.ReplayWatch.String()}
	if r.PostFormValue("confirmo") != "1" {
		keys, err := ko.BlockedKeys(ctx, sdb.DB, consumer, "", maxSequenceKeys+1)
		if err != nil {
			c.fail(w, r, err)
			return
		}
		if len(keys) > maxSequenceKeys {
			keys, view["More"] = keys[:maxSequenceKeys], true
		}
		shown := make([]string, 0, min(len(keys), keysShown))
		for _, k := range keys[:min(len(keys), keysShown)] {
			shown = append(shown, dlq.Safe(k))
		}
		view["Count"], view["Keys"], view["NotShown"] = len(keys), shown, len(keys)-len(shown)
		if len(keys) > 0 {
			view["Plan"] = c.savePlan(&plan{kind: "sequences", sel: target, ids: keys, created: c.cfg.Now()})
		}
		c.renderPage(w, r, http.StatusOK, "seqallconfirm", page{Title: "Replay every blocked sequence: confirm", Data: view})
		return
	}
	p := c.takePlan(r.PostFormValue("pla"), "sequences")
	if p == nil || p.sel != target {
		c.errorPage(w, r, http.StatusConflict, "this confirmation is not bound to a list of blocked keys the console showed for this consumer "+
			"(it expired after an hour, was used already, or the console restarted): open the blocked keys again and confirm what they list")
		return
	}
	res, err := dlq.ReplaySequences(ctx, c.cfg.Source, ko, sdb.DB, consumer, p.ids, dlq.ReplayOptions{Retention: c.cfg.Retention, Actor: actorOf(r)})
	if err != nil && len(res) == 0 {
		c.fail(w, r, err)
		return
	}
	if err != nil {
		c.cfg.Logger.Error("console: replay of every blocked sequence stopped", "consumidor", consumer, "err", err)
		view["Stopped"] = true
	}
	out, reps := make([]sequenceOutcome, len(res)), []*dlq.Report{}
	byLetter := map[string]int{}
	replayed, refused := 0, 0
	for i, sr := range res {
		out[i] = c.outcomeOf(consumer, sr)
		if out[i].Replayed {
			replayed++
			reps = append(reps, sr.Report)
			byLetter[out[i].Head] = i
		} else {
			refused++
		}
	}
	notTaken := 0
	if len(reps) > 0 {
		takes, werr := c.cfg.Source.Watch(ctx, c.cfg.ReplayWatch, 0, reps...)
		if werr != nil {
			c.cfg.Logger.Warn("console: watch of the sequence replays", "consumidor", consumer, "err", werr)
			view["WatchFailed"] = true
		} else {
			for _, t := range takes {
				if i, ok := byLetter[t.ID]; ok {
					out[i].Take = &t
					if !t.Took {
						notTaken++
					}
				}
			}
		}
	}
	c.cfg.Logger.Info("console: every blocked sequence replayed", "consumidor", consumer, "keys", len(p.ids),
		"replayed", replayed, "not_taken", notTaken, "refused", refused)
	view["Outcomes"], view["Replayed"], view["NotTaken"], view["Refused"] = out, replayed, notTaken, refused
	if err == nil {
		view["Released"] = len(p.ids) - len(res) // no longer blocked when their turn came
	}
	c.renderPage(w, r, http.StatusOK, "seqallreplayed", page{Title: "Replay every blocked sequence: result", Data: view})
}

// outcomeOf is what the result page says of one key's replay sr: its head's
// letter, whether it went back to its topic, and why not, without internals
// (the log has them).
func (c *Console) outcomeOf(consumer string, sr dlq.SequenceReplay) sequenceOutcome {
	o := sequenceOutcome{Key: dlq.Safe(sr.Key)}
	if sr.Report != nil && len(sr.Report.Items) > 0 {
		head := sr.Report.Items[0]
		o.Head, o.Replayed, o.Refused = head.ID, head.Done, head.Refused
	}
	switch {
	case sr.Err == nil:
	case o.Replayed:
		c.cfg.Logger.Error("console: sequence replay", "consumidor", consumer, "err", sr.Err)
		o.Refused = "the head was replayed, but marking the letters behind it failed (the server log has the details)"
	case errors.Is(sr.Err, dlq.ErrNoHeadLetter):
		o.Refused = "nothing to replay: its head has no pending dead letter (it waits for a retry, or was replayed already)"
	default:
		c.cfg.Logger.Error("console: sequence replay", "consumidor", consumer, "err", sr.Err)
		o.Refused = "the dead-letter index or the broker is unavailable; the server log has the details"
	}
	return o
}
