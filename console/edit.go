package console

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/km0/km0/dlq"
)

// editPage is the edit-and-replay form of a letter: its envelope as JSON,
// to edit and send in place of the original (dlq.Source.ReplayEdited).
func (c *Console) editPage(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	id, err := text(r.URL.Query().Get("id"))
	if err != nil || id == "" {
		c.errorPage(w, r, http.StatusBadRequest, "the edit form needs id")
		return
	}
	l, err := c.cfg.Source.Get(r.Context(), id)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	value, _ := dlq.PrettyValue(l.Value, 1<<20)
	c.renderEdit(w, r, http.StatusOK, l, value, "")
}

func (c *Console) renderEdit(w http.ResponseWriter, r *http.Request, code int, l *dlq.Letter, value, problem string) {
	original, _ := dlq.PrettyValue(l.Value, 1<<20)
	c.renderPage(w, r, code, "edit", page{Title: "Edit and replay " + l.ID, Data: map[string]any{
		"L": l, "Value": value, "Original": original, "Problem": problem, "Watch": c.cfg.ReplayWatch.String(),
	}})
}

// editReplay validates the edited envelope against the event's JSON Schema
// and replays it in place of the letter's own bytes (kept), then watches
// for the consumer dead-lettering it again and shows the result. A refused
// edit shows the form again with the problems; nothing is sent.
func (c *Console) editReplay(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	id, err0 := text(r.PostFormValue("id"))
	value := r.PostFormValue("valor")
	if err0 != nil || id == "" || len(value) > 1<<20 {
		c.errorPage(w, r, http.StatusBadRequest, "an edit needs id and valor (at most 1 MiB)")
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
	defer cancel()
	l, err := c.cfg.Source.Get(ctx, id)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	rep, err := c.cfg.Source.ReplayEdited(ctx, id, []byte(value), dlq.EditOptions{Actor: actorOf(r), Retention: c.cfg.Retention})
	if errors.Is(err, dlq.ErrInvalidEdit) {
		c.renderEdit(w, r, http.StatusUnprocessableEntity, l, value, dlq.Safe(strings.TrimPrefix(err.Error(), dlq.ErrInvalidEdit.Error()+": ")))
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	data := map[string]any{"L": l, "Report": rep, "Watch": c.cfg.ReplayWatch.String()}
	if rep.Done == 1 {
		takes, err := c.cfg.Source.Watch(ctx, c.cfg.ReplayWatch, 0, rep)
		if err != nil {
			c.cfg.Logger.Warn("console: watch of an edited replay", "id", id, "err", err)
			data["WatchFailed"] = true
		}
		if len(takes) == 1 {
			data["Take"] = takes[0]
		}
	}
	c.cfg.Logger.Info("console: edited replay", "id", id, "done", rep.Done, "refused", rep.Refused)
	c.renderPage(w, r, http.StatusOK, "edited", page{Title: "Edit and replay: result", Data: data})
}
