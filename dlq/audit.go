package dlq

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Audit actions (auditoria_cartes.accio).
const (
	ActionReplay = "reproduccio"
	ActionPurge  = "purga"
	ActionEdit   = "edicio"
	ActionSkip   = "salt"
)

// actorUnknown is the actor recorded when an operation names none.
const actorUnknown = "unknown"

// AuditEntry is one row of the audit log (table auditoria_cartes): an
// operation an operator ran on dead letters. Dry runs are not recorded.
type AuditEntry struct {
	ID      int64     `json:"id"`
	At      time.Time `json:"en"`
	Actor   string    `json:"qui"`
	Action  string    `json:"accio"`
	Letters []string  `json:"cartes"`
	Refused int       `json:"refusades"`
	Result  string    `json:"resultat"` // "fet", or what went wrong
}

// audit records an operation in the audit log and in the log. A failure to
// record is logged and returned; the operation itself already happened.
func (s *Service) audit(ctx context.Context, actor, action string, letters []string, refused int, result string) error {
	if actor == "" {
		actor = actorUnknown
	}
	if letters == nil {
		letters = []string{}
	}
	s.cfg.Logger.Info("dlq: audit", "actor", actor, "action", action, "letters", len(letters), "refused", refused,
		"result", result, "ids", firstIDs(letters, 20))
	_, err := s.cfg.Store.db.Exec(context.WithoutCancel(ctx), "INSERT INTO "+s.cfg.Store.audit+
		" (qui, accio, cartes, refusades, resultat) VALUES ($1, $2, $3, $4, $5)",
		pgText(actor), action, letters, refused, pgText(result))
	if err != nil {
		s.cfg.Logger.Error("dlq: audit log not written", "actor", actor, "action", action, "err", err)
		return fmt.Errorf("dlq: audit: %w", err)
	}
	return nil
}

// firstIDs is the log line's list of the letters an entry acted on: the
// first n, comma separated, and how many more (the audit table keeps all).
func firstIDs(ids []string, n int) string {
	if len(ids) > n {
		return strings.Join(ids[:n], ", ") + fmt.Sprintf(" and %d more", len(ids)-n)
	}
	return strings.Join(ids, ", ")
}

// AuditFilter selects audit entries; the zero value the newest 100.
type AuditFilter struct {
	Letter string    // entries that acted on this letter ID; "" = all
	Since  time.Time // zero = open
	Limit  int       // default 100
}

// AuditLog returns audit entries, newest first.
func (s *Store) AuditLog(ctx context.Context, f AuditFilter) ([]AuditEntry, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	var since any
	if !f.Since.IsZero() {
		since = f.Since
	}
	rows, err := s.db.Query(ctx, `SELECT id, en, qui, accio, cartes, refusades, resultat FROM `+s.audit+`
		WHERE ($1 = '' OR $1 = ANY(cartes)) AND ($2::timestamptz IS NULL OR en >= $2)
		ORDER BY id DESC LIMIT $3`, f.Letter, since, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("dlq: audit log: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (AuditEntry, error) {
		var e AuditEntry
		err := r.Scan(&e.ID, &e.At, &e.Actor, &e.Action, &e.Letters, &e.Refused, &e.Result)
		e.At = e.At.UTC()
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("dlq: audit log: %w", err)
	}
	return out, nil
}

// AuditLog returns the Service's audit entries (Store.AuditLog).
func (s *Service) AuditLog(ctx context.Context, f AuditFilter) ([]AuditEntry, error) {
	return s.cfg.Store.AuditLog(ctx, f)
}
