package console

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/km0/km0/dlq"
)

// skipSequence is the Skip button of a blocked key (page /claus and a head's
// letter page): without confirmo it shows what a skip does to the key and
// asks for the reason (the confirm step); with confirmo=1 and a reason it
// gives up the head the operator saw (form field cap) and releases the
// sequence behind it in order (dlq.SkipSequence), and shows the result.
func (c *Console) skipSequence(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	service, err0 := text(r.PostFormValue("servei"))
	consumer, err1 := text(r.PostFormValue("consumidor"))
	key, err2 := text(r.PostFormValue("clau"))
	seen, err3 := text(r.PostFormValue("cap"))
	reason, err4 := text(r.PostFormValue("motiu"))
	if err0 != nil || err1 != nil || err2 != nil || err3 != nil || err4 != nil || consumer == "" || key == "" {
		c.errorPage(w, r, http.StatusBadRequest, "a skip needs consumidor and clau")
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
	defer cancel()
	sdb, ko, seq, ok := c.blockedSequence(ctx, w, r, service, consumer, key, "skip")
	if !ok {
		return
	}
	db, ok := sdb.DB.(dlq.TxBeginner)
	if !ok {
		c.errorPage(w, r, http.StatusNotImplemented, "this service's database is not a pool: the console cannot skip its heads")
		return
	}
	view := map[string]any{"Service": sdb.Name, "Consumer": dlq.Safe(consumer), "Key": dlq.Safe(key),
		"HeadID": dlq.Safe(seq.Head.MessageID), "LastError": dlq.Safe(seq.Head.LastError), "HeadReason": seq.Head.Reason.English(),
		"Behind": len(seq.Behind) - ownRow(seq), "Reason": reason}
	var heads []string
	for _, l := range seq.HeadLetters {
		heads = append(heads, l.ID)
	}
	view["HeadLetters"] = heads
	if r.PostFormValue("confirmo") != "1" || strings.TrimSpace(reason) == "" {
		if r.PostFormValue("confirmo") == "1" {
			view["NeedReason"] = true
		}
		c.renderPage(w, r, http.StatusOK, "skipconfirm", page{Title: "Skip the head: confirm", Data: view})
		return
	}
	if seen != seq.Head.MessageID {
		c.errorPage(w, r, http.StatusConflict, "the head of this key changed since you saw it: nothing was skipped; look at the key again")
		return
	}
	rep, err := dlq.SkipSequence(ctx, c.cfg.Source, ko, db, seq, dlq.SkipOptions{Actor: actorOf(r), Reason: reason, Retention: c.cfg.Retention})
	if errors.Is(err, dlq.ErrSkipRefused) {
		c.cfg.Logger.Warn("console: skip refused", "consumidor", consumer, "err", err)
		c.errorPage(w, r, http.StatusConflict, "nothing was skipped: "+strings.TrimPrefix(err.Error(), dlq.ErrSkipRefused.Error()+": "))
		return
	}
	if err != nil && (rep == nil || rep.Skipped == nil) {
		c.fail(w, r, err)
		return
	}
	if err != nil {
		c.cfg.Logger.Error("console: skip", "consumidor", consumer, "err", err)
	}
	c.cfg.Logger.Info("console: head skipped", "consumidor", consumer, "next", rep.Next)
	view["Report"] = rep
	view["Failed"] = err != nil
	c.renderPage(w, r, http.StatusOK, "skipped", page{Title: "Skip the head: result", Data: view})
}

// ownRow is 1 when seq's head is a released message whose row is still
// stored among seq.Behind.
func ownRow(seq *dlq.Sequence) int {
	for _, p := range seq.Behind {
		if p.ID == seq.Head.MessageID {
			return 1
		}
	}
	return 0
}
