package consumer

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/migrate"
)

//go:embed sql/*.sql
var pauseFS embed.FS

// PauseMigrations creates consumidors_pausats in the schema of migrate.Names
// (default public): the consumer groups an operator paused. Apply it with
// migrate.Up beside migrate.Inbox in each consuming service's database.
var PauseMigrations = migrate.Set{Name: "consumidors_pausats", FS: pauseFS, Dir: "sql"}

// PausePollDefault is how often WatchPauses reads consumidors_pausats.
const PausePollDefault = time.Second

// Pause is the switch of Config.Pause: while it is on, the consumer takes
// no new batch (the source stops fetching once its buffer is full: Kafka's
// fetch buffer, RabbitMQ's prefetch); a batch already in a transaction
// finishes. A batch that waits for a resume is abandoned, and redelivered,
// when its lane stops (a rebalance) or the consumer stops. The zero value is
// off; a nil *Pause is never on. Safe for concurrent use.
type Pause struct {
	mu     sync.Mutex
	on     bool
	resume chan struct{} // closed when the switch goes off
}

// Set turns the switch on (paused) or off and reports whether it changed.
func (p *Pause) Set(paused bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.on == paused {
		return false
	}
	p.on = paused
	if paused {
		p.resume = make(chan struct{})
	} else if p.resume != nil {
		close(p.resume)
	}
	return true
}

// Paused reports whether the switch is on.
func (p *Pause) Paused() bool {
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.on
}

// errPausedStop abandons a batch that waited for a resume.
var errPausedStop = errors.New("consumer: paused: batch abandoned while waiting for a resume")

// wait returns nil at once when p is off, else when it goes off; an error
// when stop is closed, ctx ends or crashed is closed first.
func (p *Pause) wait(ctx context.Context, stop, crashed <-chan struct{}) error {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	on, resume := p.on, p.resume
	p.mu.Unlock()
	if !on {
		return nil
	}
	select {
	case <-resume:
		return nil
	case <-stop:
	case <-ctx.Done():
	case <-crashed:
	}
	return errPausedStop
}

// PauseDB is what the pause operations need: a pool, a connection or a
// transaction.
type PauseDB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// PausedGroup is one row of consumidors_pausats.
type PausedGroup struct {
	Group string    `json:"grup"`
	Since time.Time `json:"pausat_en"`
	By    string    `json:"per"`
}

func pauseTable(schema string) string {
	if schema == "" {
		schema = migrate.SchemaDefault
	}
	return pgx.Identifier{schema, "consumidors_pausats"}.Sanitize()
}

// PauseGroup records that group is paused (by names who, e.g. a console
// session); pausing a paused group keeps its first row. The services of the
// group stop taking batches at their next poll (WatchPauses).
func PauseGroup(ctx context.Context, db PauseDB, schema, group, by string) error {
	if group == "" {
		return errors.New("consumer: pause: empty group")
	}
	_, err := db.Exec(ctx, "INSERT INTO "+pauseTable(schema)+" (grup, per) VALUES ($1, $2) ON CONFLICT (grup) DO NOTHING", group, by)
	if err != nil {
		return fmt.Errorf("consumer: pause %s: %w", group, err)
	}
	return nil
}

// ResumeGroup removes group's pause; resuming a group that is not paused
// does nothing.
func ResumeGroup(ctx context.Context, db PauseDB, schema, group string) error {
	if _, err := db.Exec(ctx, "DELETE FROM "+pauseTable(schema)+" WHERE grup = $1", group); err != nil {
		return fmt.Errorf("consumer: resume %s: %w", group, err)
	}
	return nil
}

// PausedGroups lists the paused groups of db, by name.
func PausedGroups(ctx context.Context, db PauseDB, schema string) ([]PausedGroup, error) {
	rows, err := db.Query(ctx, "SELECT grup, pausat_en, per FROM "+pauseTable(schema)+" ORDER BY grup")
	if err != nil {
		return nil, fmt.Errorf("consumer: paused groups: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (PausedGroup, error) {
		var g PausedGroup
		err := r.Scan(&g.Group, &g.Since, &g.By)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("consumer: paused groups: %w", err)
	}
	return out, nil
}

// WatchPauses reads consumidors_pausats of db every interval (default
// PausePollDefault) until ctx ends and sets switches[group] on or off to
// match; onChange, if set, is told each change. A failed read keeps every
// switch as it is (a database outage neither pauses nor resumes) and is
// retried at the next tick; report, if set, gets its error.
func WatchPauses(ctx context.Context, db PauseDB, schema string, interval time.Duration, switches map[string]*Pause,
	onChange func(group string, paused bool), report func(error)) {
	if interval <= 0 {
		interval = PausePollDefault
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		paused, err := PausedGroups(ctx, db, schema)
		if err != nil && report != nil && ctx.Err() == nil {
			report(err)
		}
		if err == nil {
			on := map[string]bool{}
			for _, g := range paused {
				on[g.Group] = true
			}
			for g, p := range switches {
				if p.Set(on[g]) && onChange != nil {
					onChange(g, on[g])
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
