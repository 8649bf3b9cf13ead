package console

import (
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"time"

	"github.com/km0/km0/dlq"
)

// ActionTimeout bounds one purge, and each step of a replay job.
const ActionTimeout = 2 * time.Minute

// job is a replay running in the background: the page shows its progress.
type job struct {
	ID      string
	Sel     selection
	Started time.Time
	planned []string // the letters its dry run listed: all it replays
	actor   string   // who confirmed it (audit log)

	mu       sync.Mutex
	total    int
	done     int        // republished
	failed   int        // refused or not published
	arrived  int        // letters of the selection that died after the dry run: not replayed
	refused  []dlq.Item // the first ones, for the page
	state    string     // "running", "done", "failed"
	err      string     // why it stopped, without internals
	finished time.Time
}

// JobStatus is a snapshot of a job (GET /feina.json).
type JobStatus struct {
	ID          string `json:"id"`
	State       string `json:"estat"` // running, done, failed
	Selection   string `json:"seleccio"`
	Total       int    `json:"total"`
	Republished int    `json:"republicades"`
	Failed      int    `json:"fallides"`
	// Arrived counts the letters of the selection that died after the dry
	// run: the job leaves them alone (a confirmation acts on what the
	// operator saw).
	Arrived  int        `json:"arribades_despres"`
	Refused  []dlq.Item `json:"refusades,omitempty"`
	Error    string     `json:"error,omitempty"`
	Started  time.Time  `json:"iniciada"`
	Finished *time.Time `json:"acabada,omitempty"`
}

func (j *job) status() JobStatus {
	j.mu.Lock()
	defer j.mu.Unlock()
	s := JobStatus{ID: j.ID, State: j.state, Selection: j.Sel.Describe(), Total: j.total, Republished: j.done,
		Failed: j.failed, Arrived: j.arrived, Refused: append([]dlq.Item(nil), j.refused...), Error: j.err, Started: j.Started}
	if !j.finished.IsZero() {
		f := j.finished
		s.Finished = &f
	}
	return s
}

const maxShownRefusals = 100

func (c *Console) replayStart(w http.ResponseWriter, r *http.Request) {
	sel, ok := c.selection(w, r, "replay not confirmed: run the dry run first")
	if !ok {
		return
	}
	j := &job{ID: randomToken()[:16], Sel: sel, Started: c.cfg.Now(), state: "running", planned: sel.IDs, actor: actorOf(r)}
	if sel.Scope != "seleccio" {
		p := c.takePlan(r.PostFormValue("pla"), "replay")
		if p == nil {
			c.errorPage(w, r, http.StatusConflict, errNoPlan)
			return
		}
		j.planned = p.ids
	}
	c.jobsMu.Lock()
	c.pruneJobs()
	c.jobs[j.ID] = j
	c.jobsMu.Unlock()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		c.runReplay(j)
	}()
	http.Redirect(w, r, "/feina?id="+j.ID, http.StatusSeeOther)
}

// runReplay replays the letters the dry run listed (j.planned) in steps of
// ReplayChunk letters, so that the page can show its progress. Letters of
// the selection that died after the dry run are not replayed: they are
// counted (arrived) and the page says so.
func (c *Console) runReplay(j *job) {
	ctx := c.ctx
	end := func(state, msg string) {
		j.mu.Lock()
		j.state, j.err, j.finished = state, msg, c.cfg.Now()
		j.mu.Unlock()
		st := j.status()
		c.cfg.Logger.Info("console: replay finished", "job", j.ID, "selection", j.Sel.Describe(), "state", state,
			"republished", st.Republished, "failed", st.Failed)
	}
	ids := j.planned
	if j.Sel.Scope != "seleccio" {
		lctx, cancel := context.WithTimeout(ctx, ActionTimeout)
		f := j.Sel.filter()
		f.States = []dlq.State{dlq.StatePending}
		n, err := c.cfg.Source.Arrived(lctx, f, ids)
		cancel()
		if err != nil {
			c.cfg.Logger.Error("console: replay: count the letters arrived since the dry run", "job", j.ID, "err", err)
			end("failed", "the dead-letter index is unavailable; nothing was replayed")
			return
		}
		j.mu.Lock()
		j.arrived = n
		j.mu.Unlock()
	}
	j.mu.Lock()
	j.total = len(ids)
	j.mu.Unlock()
	for start := 0; start < len(ids); start += ReplayChunk {
		chunk := ids[start:min(start+ReplayChunk, len(ids))]
		sctx, cancel := context.WithTimeout(ctx, ActionTimeout)
		rep, err := c.cfg.Source.Replay(sctx, dlq.Filter{IDs: chunk}, dlq.ReplayOptions{Force: j.Sel.Force, Retention: c.cfg.Retention, Actor: j.actor})
		cancel()
		if err != nil {
			c.cfg.Logger.Error("console: replay", "job", j.ID, "err", err)
			j.mu.Lock()
			j.failed += len(ids) - start // a failed step marks nothing
			j.mu.Unlock()
			end("failed", "publishing failed (broker or index unavailable); the letters not republished stay pending, and replaying again is safe")
			return
		}
		j.mu.Lock()
		j.done += rep.Done
		j.failed += rep.Refused
		for _, it := range rep.Items {
			if !it.Done && len(j.refused) < maxShownRefusals {
				j.refused = append(j.refused, it)
			}
		}
		j.mu.Unlock()
	}
	end("done", "")
}

// keepJobs is how long a finished job's page stays available.
const keepJobs = 24 * time.Hour

// pruneJobs forgets jobs finished more than keepJobs ago. c.jobsMu is held.
func (c *Console) pruneJobs() {
	for id, j := range c.jobs {
		j.mu.Lock()
		old := !j.finished.IsZero() && c.cfg.Now().Sub(j.finished) > keepJobs
		j.mu.Unlock()
		if old {
			delete(c.jobs, id)
		}
	}
}

func (c *Console) job(w http.ResponseWriter, r *http.Request) *job {
	c.jobsMu.Lock()
	j := c.jobs[r.URL.Query().Get("id")]
	c.jobsMu.Unlock()
	if j == nil {
		c.errorPage(w, r, http.StatusNotFound, "no such job (jobs are kept in memory until the console restarts)")
	}
	return j
}

func (c *Console) jobPage(w http.ResponseWriter, r *http.Request) {
	j := c.job(w, r)
	if j == nil {
		return
	}
	st := j.status()
	p := page{Title: "Replay", Data: st}
	if st.State == "running" {
		p.Refresh = 1 // the page also updates itself by script; this works without it
	}
	c.renderPage(w, r, http.StatusOK, "job", p)
}

func (c *Console) jobJSON(w http.ResponseWriter, r *http.Request) {
	j := c.job(w, r)
	if j == nil {
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(j.status())
}
