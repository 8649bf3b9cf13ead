package console

import (
	"net/http"

	"github.com/km0/km0/dlq"
)

type auditRow struct {
	dlq.AuditEntry
	What  string   // the action for people (dlq.ActionEnglish); Action keeps the stored value
	Shown []string // the first letters
	More  int      // how many letters are not shown
}

// auditPage is the audit log (dlq.Source.AuditLog): every replay, purge,
// edit and skip an operator ran, newest first, with who (the console
// session or the CLI user), when, which letters and the result; ?carta=ID
// narrows it to one letter.
func (c *Console) auditPage(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	letter, err := text(r.URL.Query().Get("carta"))
	if err != nil {
		c.errorPage(w, r, http.StatusBadRequest, "bad carta")
		return
	}
	log, err := c.cfg.Source.AuditLog(r.Context(), dlq.AuditFilter{Letter: letter, Limit: 200})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	rows := make([]auditRow, len(log))
	for i, e := range log {
		// What people read is English; the stored Catalan (accio, resultat) stays in the index.
		e.Actor, e.Result = dlq.Safe(e.Actor), dlq.Safe(dlq.ResultEnglish(e.Result))
		row := auditRow{AuditEntry: e, What: dlq.Safe(dlq.ActionEnglish(e.Action)), Shown: e.Letters}
		if len(row.Shown) > 10 {
			row.Shown, row.More = row.Shown[:10], len(e.Letters)-10
		}
		rows[i] = row
	}
	c.renderPage(w, r, http.StatusOK, "audit", page{Title: "Audit log", Refresh: refreshSeconds, Data: map[string]any{
		"Rows": rows, "Letter": letter,
	}})
}
