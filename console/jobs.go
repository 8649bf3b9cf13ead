package console

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/km0/km0/dlq"
)

// actionTimeout bounds one purge, and the reads of a replay job's page.
const actionTimeout = 2 * time.Minute

// maxRate caps the pace an operator may ask of a replay job (letters per
// second).
const maxRate = 1000.0

// job is what this console process knows of a replay job besides what the
// library keeps of it (dlq.Source.CreateJob: its letters, pace, state and
// progress, in the index, so that a restarted console resumes it without
// replaying a letter twice).
type job struct {
	ID        string
	Selection string // "" for a job resumed after a restart
	Force     bool
	arrived   int // letters of the selection that died after the dry run: not replayed
	copies    int // duplicate copies marked purged at the confirmation (copies.go)

	mu      sync.Mutex
	running bool
	err     string // why its last run stopped, without internals
}

// replayJob is a snapshot of a job (GET /feina.json).
type replayJob struct {
	ID string `json:"id"`
	// State is running, pending (not running in this console: resume it),
	// failed (its run stopped on an error: resume it), cancelled or done.
	State       string  `json:"estat"`
	Selection   string  `json:"seleccio"`
	Rate        float64 `json:"per_segon"`
	Total       int     `json:"total"`
	Republished int     `json:"republicades"`
	Failed      int     `json:"fallides"` // refused
	Left        int     `json:"pendents"`
	// Arrived counts the letters of the selection that died after the dry
	// run: the job leaves them alone (a confirmation acts on what the
	// operator saw).
	Arrived int `json:"arribades_despres"`
	// Copies counts the duplicate copies of the replayed letters (the same
	// event dead in the same consumer) marked purged at the confirmation:
	// one copy is replayed.
	Copies   int        `json:"copies_purgades"`
	Error    string     `json:"error,omitempty"`
	Actor    string     `json:"qui"`
	Started  time.Time  `json:"iniciada"`
	Finished *time.Time `json:"acabada,omitempty"`
}

// jobEnded names for people the state RunJob leaves a job in: done,
// cancelled, else pending (the index's estat is acabada, cancellada or
// pendent).
func jobEnded(state string) string {
	switch state {
	case dlq.JobFinished:
		return "done"
	case dlq.JobCancelled:
		return "cancelled"
	}
	return "pending"
}

// jobStatus is job id's status from the index and this console's memory.
func (c *Console) jobStatus(ctx context.Context, id string) (replayJob, error) {
	// The runner's flag is read before the index: RunJob records the job
	// finished before it clears the flag, so a runner seen stopped here
	// has either finished (the index says so below) or stopped early.
	// Read the other way round, a job finishing in between showed
	// "pending" with its last letter left.
	c.jobsMu.Lock()
	j := c.jobs[id]
	c.jobsMu.Unlock()
	running, errText := false, ""
	var arrived, copies int
	var selection string
	if j != nil {
		j.mu.Lock()
		running, errText = j.running, j.err
		j.mu.Unlock()
		arrived, copies, selection = j.arrived, j.copies, j.Selection
	}
	st, err := c.cfg.Source.JobStatus(ctx, id)
	if err != nil {
		return replayJob{}, err
	}
	s := replayJob{ID: st.ID, Rate: st.Rate, Total: st.Total, Republished: st.Done, Failed: st.Refused, Left: st.Left,
		Actor: dlq.Safe(st.Actor), Started: st.Created, Selection: "resumed after a restart of the console",
		Error: errText, Arrived: arrived, Copies: copies}
	if !st.Finished.IsZero() {
		f := st.Finished
		s.Finished = &f
	}
	if selection != "" {
		s.Selection = selection
	}
	switch {
	case st.State == dlq.JobFinished || st.State == dlq.JobCancelled:
		s.State = jobEnded(st.State)
	case running:
		s.State = "running"
	case s.Error != "":
		s.State = "failed"
	default:
		s.State = "pending"
	}
	return s, nil
}

func (c *Console) replayStart(w http.ResponseWriter, r *http.Request) {
	sel, ok := c.selection(w, r, "replay not confirmed: run the dry run first")
	if !ok {
		return
	}
	rate := dlq.JobRateDefault
	if v := r.PostFormValue("per_segon"); v != "" {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || !(f > 0) || f > maxRate {
			c.errorPage(w, r, http.StatusBadRequest, "per_segon: the pace is a number of letters per second, above 0 and at most 1000")
			return
		}
		rate = f
	}
	p := c.takePlan(r.PostFormValue("pla"), "replay")
	if p == nil {
		c.errorPage(w, r, http.StatusConflict, errNoPlan)
		return
	}
	planned := p.ids
	if len(planned) > dlq.JobMaxLetters {
		c.errorPage(w, r, http.StatusRequestEntityTooLarge, "too many letters for one replay job: at most "+strconv.Itoa(dlq.JobMaxLetters)+"; narrow the selection")
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
	defer cancel()
	arrived := 0
	if sel.Scope != "seleccio" {
		f := sel.filter()
		f.States = []dlq.State{dlq.StatePending}
		n, err := c.cfg.Source.Arrived(ctx, f, append(slices.Clone(planned), p.copies...))
		if err != nil {
			c.cfg.Logger.Error("console: replay: count the letters arrived since the dry run", "err", err)
			c.errorPage(w, r, http.StatusServiceUnavailable, "the dead-letter index is unavailable; nothing was replayed")
			return
		}
		arrived = n
	}
	copies := 0
	if len(p.copies) > 0 {
		// Before the job: should it not start, one copy of each event is
		// still pending, and nothing is lost.
		rep, err := c.cfg.Source.Purge(ctx, dlq.Filter{IDs: p.copies}, dlq.PurgeOptions{Confirmed: true, Actor: actorOf(r)})
		if err != nil {
			c.fail(w, r, err)
			return
		}
		copies = rep.Done
	}
	id, err := c.cfg.Source.CreateJob(ctx, planned, rate, actorOf(r))
	if errors.Is(err, dlq.ErrJobTooLarge) {
		c.errorPage(w, r, http.StatusRequestEntityTooLarge, "too many letters for one replay job: at most "+strconv.Itoa(dlq.JobMaxLetters)+"; narrow the selection")
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	j := &job{ID: id, Selection: sel.Describe(), Force: sel.Force, arrived: arrived, copies: copies}
	c.startJob(j)
	http.Redirect(w, r, "/feina?id="+id, http.StatusSeeOther)
}

// startJob runs j in the background (dlq.Source.RunJob) unless it runs
// already; it stops when the console closes, and resumes when a console
// starts again (resumeJobs).
func (c *Console) startJob(j *job) {
	c.jobsMu.Lock()
	if old := c.jobs[j.ID]; old != nil {
		j = old
	} else {
		c.jobs[j.ID] = j
	}
	c.jobsMu.Unlock()
	j.mu.Lock()
	if j.running {
		j.mu.Unlock()
		return
	}
	j.running, j.err = true, ""
	j.mu.Unlock()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		st, err := c.cfg.Source.RunJob(c.ctx, j.ID, dlq.ReplayOptions{Force: j.Force, Retention: c.cfg.Retention})
		j.mu.Lock()
		j.running = false
		switch {
		case errors.Is(err, dlq.ErrJobRunning):
			j.err = "another console runs this job now; this one leaves it alone"
		case err != nil && c.ctx.Err() == nil:
			j.err = "publishing failed (broker or index unavailable); the letters not republished stay pending: resume the job"
		}
		j.mu.Unlock()
		switch {
		case err != nil && c.ctx.Err() != nil:
			c.cfg.Logger.Info("console: replay job stopped with the console; it resumes when the console starts again", "job", j.ID)
		case err != nil:
			c.cfg.Logger.Error("console: replay job", "job", j.ID, "err", err)
		default:
			c.cfg.Logger.Info("console: replay job ended", "job", j.ID, "state", jobEnded(st.State), "done", st.Done, "refused", st.Refused, "left", st.Left)
		}
	}()
}

// resumeJobs starts again every replay job left pending in the index (a
// console stopped or killed while it ran): each letter a job replayed stays
// counted, so none is replayed twice; a job created with force resumes with
// it (the index keeps it).
func (c *Console) resumeJobs() {
	if c.cfg.Source == nil {
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, actionTimeout)
	defer cancel()
	ids, err := c.cfg.Source.PendingJobs(ctx)
	if err != nil {
		c.cfg.Logger.Error("console: replay jobs to resume", "err", err)
		return
	}
	for _, id := range ids {
		c.cfg.Logger.Info("console: resuming replay job", "job", id)
		c.startJob(&job{ID: id})
	}
}

func (c *Console) jobID(w http.ResponseWriter, r *http.Request, id string) (replayJob, bool) {
	ctx, cancel := context.WithTimeout(r.Context(), actionTimeout)
	defer cancel()
	st, err := c.jobStatus(ctx, id)
	if errors.Is(err, dlq.ErrNotFound) {
		c.errorPage(w, r, http.StatusNotFound, "no such replay job")
		return st, false
	}
	if err != nil {
		c.fail(w, r, err)
		return st, false
	}
	return st, true
}

func (c *Console) jobPage(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	st, ok := c.jobID(w, r, r.URL.Query().Get("id"))
	if !ok {
		return
	}
	p := page{Title: "Replay", Data: st}
	if st.State == "running" {
		p.Refresh = 2 // the page also updates itself by script; this works without it
	}
	c.renderPage(w, r, http.StatusOK, "job", p)
}

func (c *Console) jobJSON(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	st, ok := c.jobID(w, r, r.URL.Query().Get("id"))
	if !ok {
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(st)
}

// jobCancel cancels a replay job (dlq.Source.CancelJob): it stops before
// its next letter; what it replayed stays replayed.
func (c *Console) jobCancel(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	id, err := text(r.PostFormValue("id"))
	if err != nil || id == "" {
		c.errorPage(w, r, http.StatusBadRequest, "cancelling a job needs id")
		return
	}
	if _, ok := c.jobID(w, r, id); !ok {
		return
	}
	if err := c.cfg.Source.CancelJob(r.Context(), id); err != nil {
		c.fail(w, r, err)
		return
	}
	c.cfg.Logger.Info("console: replay job cancelled", "job", id, "actor", actorOf(r))
	http.Redirect(w, r, "/feina?id="+id, http.StatusSeeOther)
}

// jobResume runs a pending job again (after it failed, or one another
// console left).
func (c *Console) jobResume(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	id, err := text(r.PostFormValue("id"))
	if err != nil || id == "" {
		c.errorPage(w, r, http.StatusBadRequest, "resuming a job needs id")
		return
	}
	st, ok := c.jobID(w, r, id)
	if !ok {
		return
	}
	if st.State == "pending" || st.State == "failed" {
		c.startJob(&job{ID: id})
	}
	http.Redirect(w, r, "/feina?id="+id, http.StatusSeeOther)
}
