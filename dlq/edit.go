package dlq

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/schema"
)

// ErrInvalidEdit wraps every reason ReplayEdited refuses an edited payload.
var ErrInvalidEdit = errors.New("dlq: edited payload refused")

// EditOptions tune ReplayEdited.
type EditOptions struct {
	// Actor names who edits, for the audit log. Default "unknown".
	Actor string
	// Schemas validates the edited dades. Default schema.Default() (the
	// schemas of package schemas).
	Schemas *schema.Registry
	// Retention and Force are Replay's.
	Retention time.Duration
	Force     bool
}

// ReplayEdited replays letter id with value, an operator's edit of its
// envelope, in place of its own bytes: same key, addressed to the same
// consumer, marked replayed as Replay does. The edit must be a valid envelope
// with the letter's id_esdeveniment and tipus (the consumers' inbox must
// recognise the event), and its dades must validate against the JSON Schema
// of its tipus and versio; otherwise nothing is sent and the error wraps
// ErrInvalidEdit with the schema's problems. The letter's original bytes stay
// in the index; the edit is kept in cartes_editades and the audit log
// records it (ActionEdit). A letter Replay would refuse is refused alike.
func (s *Service) ReplayEdited(ctx context.Context, id string, value []byte, o EditOptions) (*Report, error) {
	l, err := s.cfg.Store.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := validateEdit(l, value, o.Schemas); err != nil {
		return nil, err
	}
	if _, err := s.cfg.Store.db.Exec(ctx, "INSERT INTO "+s.cfg.Store.edits+" (id_carta, qui, valor) VALUES ($1, $2, $3)",
		id, pgText(cmpOr(o.Actor, actorUnknown)), value); err != nil {
		return nil, fmt.Errorf("dlq: keep the edit: %w", err)
	}
	return s.Replay(ctx, Filter{IDs: []string{id}}, ReplayOptions{Actor: o.Actor, Retention: o.Retention, Force: o.Force,
		action: ActionEdit, values: map[string][]byte{id: value}})
}

// validateEdit checks an edited envelope against its letter and its schema.
func validateEdit(l *Letter, value []byte, reg *schema.Registry) error {
	e, err := envelope.Decode(value)
	if err != nil {
		return fmt.Errorf("%w: not a valid envelope: %v", ErrInvalidEdit, err)
	}
	if l.EventID != "" && e.ID != l.EventID {
		return fmt.Errorf("%w: id_esdeveniment changed from %s to %s: the consumers could not recognise the event",
			ErrInvalidEdit, Safe(l.EventID), Safe(e.ID))
	}
	if l.Type != "" && e.Type != l.Type {
		return fmt.Errorf("%w: tipus changed from %s to %s", ErrInvalidEdit, Safe(l.Type), Safe(e.Type))
	}
	if reg == nil {
		if reg, err = schema.Default(); err != nil {
			return fmt.Errorf("dlq: schemas: %w", err)
		}
	}
	if err := reg.Validate(e.Type, e.Version, e.Data); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalidEdit, err)
	}
	return nil
}

// Edits returns the payloads sent in place of letter id by ReplayEdited,
// oldest first.
func (s *Store) Edits(ctx context.Context, id string) ([][]byte, error) {
	rows, err := s.db.Query(ctx, "SELECT valor FROM "+s.edits+" WHERE id_carta = $1 ORDER BY id", id)
	if err != nil {
		return nil, fmt.Errorf("dlq: edits: %w", err)
	}
	var out [][]byte
	for rows.Next() {
		var v []byte
		if err := rows.Scan(&v); err != nil {
			rows.Close()
			return nil, fmt.Errorf("dlq: edits: %w", err)
		}
		out = append(out, v)
	}
	return out, rows.Err()
}
