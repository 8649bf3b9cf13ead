package console

import (
	"net/http"
	"time"
)

// A plan binds a confirmation to what its dry run listed: the exact letter
// IDs the operator saw. The replay or purge it confirms acts on those IDs,
// never on the group or filter resolved again, and says how many letters
// arrived since (dlq.Source.Arrived). A plan of kind "sequences" holds the
// blocked keys of one consumer its confirm page listed (sequences.go).
type plan struct {
	kind string // "replay", "purge" or "sequences"
	sel  string // the selection's Describe, for the log; for "sequences", the service and consumer
	ids  []string
	// copies are, for a replay, the other pending copies of the letters in
	// ids (the same event dead in the same consumer more than once): the
	// replay of one covers them, and they are marked purged when it is
	// confirmed (folded rows, copies.go).
	copies  []string
	created time.Time
}

// Bounds of the plans kept in memory.
const (
	planTTL  = time.Hour
	maxPlans = 1000
)

// savePlan stores p and returns its token (a form field, pla).
func (c *Console) savePlan(p *plan) string {
	tok := randomToken()[:22]
	c.jobsMu.Lock()
	defer c.jobsMu.Unlock()
	now := c.cfg.Now()
	var oldest string
	for k, q := range c.plans {
		if now.Sub(q.created) > planTTL {
			delete(c.plans, k)
			continue
		}
		if oldest == "" || q.created.Before(c.plans[oldest].created) {
			oldest = k
		}
	}
	if len(c.plans) >= maxPlans && oldest != "" {
		delete(c.plans, oldest)
	}
	c.plans[tok] = p
	return tok
}

// takePlan returns and forgets the plan of tok for kind; nil when there is
// none (unknown, expired, used, or made for the other action). The form
// carrying tok is CSRF-protected; its selection fields only describe the
// job: the plan's IDs are what it acts on.
func (c *Console) takePlan(tok, kind string) *plan {
	c.jobsMu.Lock()
	defer c.jobsMu.Unlock()
	p := c.plans[tok]
	if p == nil || p.kind != kind || c.cfg.Now().Sub(p.created) > planTTL {
		return nil
	}
	delete(c.plans, tok)
	return p
}

// errNoPlan is the answer to a confirmation without a valid plan.
const errNoPlan = "this confirmation is not bound to a dry run the console knows (it expired after an hour, " +
	"was used already, or the console restarted): run the dry run again and confirm what it lists"

// actorOf is who acts, for the audit log: the session's identity, or
// "console" when the console runs without a token.
func actorOf(r *http.Request) string {
	if s := sessionOf(r); s != nil && s.actor != "" {
		return s.actor
	}
	return "console"
}
