package dlq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Defaults of bulk replay jobs.
const (
	// JobMaxLetters caps the letters of one job.
	JobMaxLetters = 10000
	// JobRateDefault is the pace of a job: letters replayed per second.
	JobRateDefault = 50.0
)

// Job states (feines_reproduccio.estat).
const (
	JobPending   = "pendent"    // created or running: Run replays what is left
	JobCancelled = "cancellada" // CancelJob: Run stops before the next letter
	JobFinished  = "acabada"
)

// ErrJobTooLarge is returned by CreateJob for more than JobMaxLetters letters.
var ErrJobTooLarge = errors.New("dlq: too many letters for one replay job")

// ErrJobRunning is returned by RunJob for a job another RunJob runs now (in
// this process or another one on the same index).
var ErrJobRunning = errors.New("dlq: this replay job is running elsewhere")

// JobStatus is a bulk replay job and its progress.
type JobStatus struct {
	ID       string    `json:"id"`
	Actor    string    `json:"qui"`
	Created  time.Time `json:"creada_en"`
	Rate     float64   `json:"per_segon"`
	State    string    `json:"estat"`
	Total    int       `json:"total"`
	Done     int       `json:"fetes"`
	Refused  int       `json:"refusades"`
	Left     int       `json:"pendents"`
	Finished time.Time `json:"acabada_en,omitempty"`
}

// CreateJob records a bulk replay job of exactly ids, in this order (a
// snapshot, as a dry run listed them), to be replayed at rate letters per
// second (0: JobRateDefault) by RunJob. It fails for no letters, or more
// than JobMaxLetters (ErrJobTooLarge).
func (s *Service) CreateJob(ctx context.Context, ids []string, rate float64, actor string) (string, error) {
	if len(ids) == 0 {
		return "", errors.New("dlq: a replay job needs letters")
	}
	if len(ids) > JobMaxLetters {
		return "", fmt.Errorf("%w: %d > %d", ErrJobTooLarge, len(ids), JobMaxLetters)
	}
	if rate <= 0 {
		rate = JobRateDefault
	}
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	st := s.cfg.Store
	tx, err := st.db.Begin(ctx)
	if err != nil {
		return "", fmt.Errorf("dlq: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	if _, err := tx.Exec(ctx, "INSERT INTO "+st.jobs+" (id, qui, per_segon) VALUES ($1, $2, $3)",
		id, pgText(cmpOr(actor, actorUnknown)), rate); err != nil {
		return "", fmt.Errorf("dlq: create job: %w", err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+st.jobLetters+" (id_feina, ordre, id_carta) "+
		"SELECT $1, o, c FROM unnest($2::text[]) WITH ORDINALITY AS u(c, o)", id, ids); err != nil {
		return "", fmt.Errorf("dlq: create job: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return "", fmt.Errorf("dlq: create job: %w", err)
	}
	return id, nil
}

// CancelJob stops job id: a running RunJob stops before its next letter,
// and what it replayed stays replayed. Cancelling a finished job changes
// nothing.
func (s *Service) CancelJob(ctx context.Context, id string) error {
	_, err := s.cfg.Store.db.Exec(ctx, "UPDATE "+s.cfg.Store.jobs+" SET estat = 'cancellada' WHERE id = $1 AND estat = 'pendent'", id)
	if err != nil {
		return fmt.Errorf("dlq: cancel job: %w", err)
	}
	return nil
}

// RunJob replays the letters of job id still pending, one at a time, in
// order, at the job's pace, until none is left (the job is then finished),
// the job is cancelled, or ctx ends. Each letter's state is recorded after
// its replay; after a crash in between, the resumed job finds the letter
// already replayed since the job was created and counts it done, so no
// letter is replayed twice by a job. Run it again after a restart to resume.
// A job once run with o.Force keeps it: a resumed run forces too. One
// RunJob runs a job at a time (ErrJobRunning otherwise) when the
// Store's DB is a pgxpool.Pool. Each run is one entry of the audit log: the letters it replayed, the
// number it refused, and "fet", "cancelled" or why it stopped.
func (s *Service) RunJob(ctx context.Context, id string, o ReplayOptions) (_ *JobStatus, err error) {
	st := s.cfg.Store
	var rate float64
	var created time.Time
	var actor string
	var force bool
	if err := st.db.QueryRow(ctx, "SELECT per_segon, creada_en, qui, forcar FROM "+st.jobs+" WHERE id = $1", id).Scan(&rate, &created, &actor, &force); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, fmt.Errorf("%w: job %s", ErrNotFound, id)
		}
		return nil, fmt.Errorf("dlq: job: %w", err)
	}
	// One runner per job: two consoles resuming it at once would replay a
	// letter twice. A session lock on a connection of its own, released when
	// RunJob returns or its process dies.
	if p, ok := st.db.(*pgxpool.Pool); ok {
		conn, err := p.Acquire(ctx)
		if err != nil {
			return nil, fmt.Errorf("dlq: job: %w", err)
		}
		defer conn.Release()
		lock := "km0.dlq.feina:" + st.jobs + ":" + id
		var got bool
		if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock(hashtextextended($1, 0))", lock).Scan(&got); err != nil {
			return nil, fmt.Errorf("dlq: job: %w", err)
		}
		if !got {
			return nil, fmt.Errorf("%w: job %s", ErrJobRunning, id)
		}
		defer conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock(hashtextextended($1, 0))", lock) //nolint:errcheck // the session ends with the connection otherwise
	}
	if o.Force && !force {
		// Kept for a resumed run, which may not know it.
		if _, err := st.db.Exec(ctx, "UPDATE "+st.jobs+" SET forcar = true WHERE id = $1", id); err != nil {
			return nil, fmt.Errorf("dlq: job: %w", err)
		}
	}
	o.Force = o.Force || force
	o.Actor, o.DryRun, o.noAudit = cmpOr(o.Actor, actor), false, true
	// One audit entry per run of the job, not one per letter: what this
	// run replayed and refused, and how it ended.
	var done []string
	refused := 0
	ended := "fet"
	audited := false
	record := func() {
		if audited || (len(done) == 0 && refused == 0) {
			return
		}
		audited = true
		result := ended
		if err != nil {
			result = "stopped: " + err.Error()
		}
		_ = s.audit(ctx, o.Actor, cmpOr(o.action, ActionReplay), done, refused, result)
	}
	defer record()
	pace := time.Duration(float64(time.Second) / rate)
	next := time.Now()
	for {
		var state string
		if err := st.db.QueryRow(ctx, "SELECT estat FROM "+st.jobs+" WHERE id = $1", id).Scan(&state); err != nil {
			return nil, fmt.Errorf("dlq: job: %w", err)
		}
		if state != JobPending {
			ended = "cancelled"
			return s.JobStatus(ctx, id)
		}
		var ordre int
		var letter string
		err := st.db.QueryRow(ctx, "SELECT ordre, id_carta FROM "+st.jobLetters+
			" WHERE id_feina = $1 AND estat = 'pendent' ORDER BY ordre LIMIT 1", id).Scan(&ordre, &letter)
		if errors.Is(err, pgx.ErrNoRows) {
			record() // before the job shows finished
			if _, err := st.db.Exec(ctx, "UPDATE "+st.jobs+" SET estat = 'acabada', acabada_en = now() WHERE id = $1 AND estat = 'pendent'", id); err != nil {
				return nil, fmt.Errorf("dlq: job: %w", err)
			}
			return s.JobStatus(ctx, id)
		}
		if err != nil {
			return nil, fmt.Errorf("dlq: job: %w", err)
		}
		if d := time.Until(next); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil, ctx.Err()
			case <-t.C:
			}
		}
		next = time.Now().Add(pace)
		itemState, detail, err := s.jobStep(ctx, letter, created, o)
		if err != nil {
			return nil, err // the letter stays pending: a resumed job looks at it again
		}
		if _, err := st.db.Exec(ctx, "UPDATE "+st.jobLetters+" SET estat = $3, detall = nullif($4, '') WHERE id_feina = $1 AND ordre = $2",
			id, ordre, itemState, detail); err != nil {
			return nil, fmt.Errorf("dlq: job: %w", err)
		}
		if itemState == "fet" {
			done = append(done, letter)
		} else {
			refused++
		}
	}
}

// jobStep replays one letter of a job created at created: "fet" if it was
// replayed now or already since the job was created (a step cut short by a
// crash), else "refusat" and why.
func (s *Service) jobStep(ctx context.Context, letter string, created time.Time, o ReplayOptions) (string, string, error) {
	l, err := s.cfg.Store.Get(ctx, letter)
	if errors.Is(err, ErrNotFound) {
		return "refusat", "not in the index", nil
	}
	if err != nil {
		return "", "", err
	}
	if l.State == StateReplayed && !l.ReplayedAt.Before(created) {
		return "fet", "", nil
	}
	rep, err := s.Replay(ctx, Filter{IDs: []string{letter}}, o)
	if err != nil {
		return "", "", err
	}
	if rep.Done == 1 {
		return "fet", "", nil
	}
	why := "refused"
	if len(rep.Items) > 0 {
		why = rep.Items[0].Refused
	}
	return "refusat", why, nil
}

// JobStatus returns job id and its progress.
func (s *Service) JobStatus(ctx context.Context, id string) (*JobStatus, error) {
	st := s.cfg.Store
	j := &JobStatus{ID: id}
	var fin *time.Time
	err := st.db.QueryRow(ctx, `SELECT f.qui, f.creada_en, f.per_segon, f.estat, f.acabada_en,
		count(c.*), count(c.*) FILTER (WHERE c.estat = 'fet'), count(c.*) FILTER (WHERE c.estat = 'refusat'),
		count(c.*) FILTER (WHERE c.estat = 'pendent')
		FROM `+st.jobs+` f LEFT JOIN `+st.jobLetters+` c ON c.id_feina = f.id WHERE f.id = $1 GROUP BY f.id`, id).
		Scan(&j.Actor, &j.Created, &j.Rate, &j.State, &fin, &j.Total, &j.Done, &j.Refused, &j.Left)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: job %s", ErrNotFound, id)
	}
	if err != nil {
		return nil, fmt.Errorf("dlq: job status: %w", err)
	}
	j.Created = j.Created.UTC()
	j.Finished = derefTime(fin)
	return j, nil
}

// PendingJobs returns the IDs of the jobs neither finished nor cancelled,
// oldest first: the jobs a restarted runner (the console) resumes with
// RunJob.
func (s *Service) PendingJobs(ctx context.Context) ([]string, error) {
	rows, err := s.cfg.Store.db.Query(ctx, "SELECT id FROM "+s.cfg.Store.jobs+" WHERE estat = 'pendent' ORDER BY creada_en, id")
	if err != nil {
		return nil, fmt.Errorf("dlq: pending jobs: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("dlq: pending jobs: %w", err)
	}
	return ids, nil
}
