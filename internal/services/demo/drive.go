package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/km0/km0/internal/pause"
)

// Submissions counts what POST /comandes answered.
type Submissions struct {
	Planned       int `json:"planned"`
	Requests      int `json:"requests"`
	Accepted      int `json:"accepted"`                  // first 201 of each order
	Replayed      int `json:"duplicates_absorbed"`       // answers replayed for a repeated Idempotency-Key
	ReplayDiffers int `json:"duplicates_differing"`      // a replay whose id_esdeveniment or capacitat differs (must be 0)
	Invalid       int `json:"refused_validation"`        // 400
	Refused       int `json:"refused_payment"`           // 402
	NotCovered    int `json:"refused_ciutat_no_coberta"` // 422 codi ciutat_no_coberta
	Conflict      int `json:"conflicts"`                 // 409
	Unavailable   int `json:"unavailable_503"`           // 503 answers (then retried with the same key)
	Other         int `json:"other"`                     // anything else (must be 0)
	Unexpected    int `json:"unexpected"`                // a status other than the plan expects (must be 0)
	Unanswered    int `json:"unanswered"`                // orders still without a final answer when the drive was cut short
	Cancelled     int `json:"cancelled_by_client"`       // POST /comandes/{id}/cancellacio answered 200 (twice each: the repeat answers the same)
	CancelDiffers int `json:"cancellations_differing"`   // a repeated cancellation answered another body (must be 0)

	accepted map[string]string // order id → id_esdeveniment of its first answer
	caps     map[string]string // order id → capacitat of its first 201: the credential of its cancellation
}

type answer struct {
	status     int
	eventID    string
	capability string // capacitat of a 201
	replayed   bool
}

// driver submits the plan with several concurrent clients.
type driver struct {
	url     string
	client  *http.Client
	mu      sync.Mutex
	res     Submissions
	sent    atomic.Int64
	onOrder func(done int) // called after each planned order
	// gate, if set, is called before the i-th order is handed to a client
	// and may wait (km0 demo --chaos paces orders over its duration).
	gate func(ctx context.Context, i int)
}

func (d *driver) post(ctx context.Context, p *planned) (answer, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.url+"/comandes", bytes.NewReader(p.body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", p.key)
	resp, err := d.client.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	var body struct {
		EventID    string `json:"id_esdeveniment"`
		Capability string `json:"capacitat"`
	}
	raw, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(raw, &body)
	return answer{status: resp.StatusCode, eventID: body.EventID, capability: body.Capability,
		replayed: resp.Header.Get("Idempotent-Replayed") == "true"}, nil
}

// submit posts p until it gets a final answer: a 503 or a network error is
// retried with the same Idempotency-Key, as a careful client does.
func (d *driver) submit(ctx context.Context, p *planned) answer {
	for fails := 1; ; fails++ {
		a, err := d.post(ctx, p)
		d.mu.Lock()
		d.res.Requests++
		if err == nil && a.status == http.StatusServiceUnavailable {
			d.res.Unavailable++
		}
		d.mu.Unlock()
		if err == nil && a.status != http.StatusServiceUnavailable {
			return a
		}
		select {
		case <-ctx.Done():
			return answer{}
		case <-time.After(pause.Backoff(100*time.Millisecond, 2*time.Second, fails)):
		}
	}
}

func (d *driver) record(p *planned, a answer) {
	d.mu.Lock()
	defer d.mu.Unlock()
	want := http.StatusCreated
	switch {
	case p.invalid:
		want = http.StatusBadRequest
	case p.uncovered:
		want = http.StatusUnprocessableEntity // checked before the card
	case p.refused:
		want = http.StatusPaymentRequired
	}
	if a.status != want {
		d.res.Unexpected++
	}
	switch a.status {
	case http.StatusCreated:
		if first, seen := d.res.accepted[p.order.ID]; seen {
			if !a.replayed {
				d.res.Unexpected++ // a second 201 that was not a replay: created twice
			}
			d.res.Replayed++
			if first != a.eventID || d.res.caps[p.order.ID] != a.capability {
				d.res.ReplayDiffers++
			}
			return
		}
		d.res.Accepted++
		d.res.accepted[p.order.ID] = a.eventID
		d.res.caps[p.order.ID] = a.capability
	case http.StatusBadRequest:
		d.res.Invalid++
	case http.StatusPaymentRequired:
		d.res.Refused++
	case http.StatusUnprocessableEntity:
		d.res.NotCovered++
	case http.StatusConflict:
		d.res.Conflict++
	default:
		d.res.Other++
	}
}

// run submits plan with clients concurrent clients; a duplicate order is
// submitted twice at the same moment with the same key.
func (d *driver) run(ctx context.Context, plan []*planned, clients int) Submissions {
	d.res = Submissions{Planned: len(plan), accepted: map[string]string{}, caps: map[string]string{}}
	work := make(chan *planned)
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for p := range work {
				n := 1
				if p.duplicate {
					n = 2
				}
				answers := make([]answer, n)
				var inner sync.WaitGroup
				for i := range n {
					inner.Go(func() { answers[i] = d.submit(ctx, p) })
				}
				inner.Wait()
				// Record the original (non-replayed) answer first.
				if n == 2 && answers[0].replayed {
					answers[0], answers[1] = answers[1], answers[0]
				}
				if ctx.Err() != nil {
					d.mu.Lock()
					d.res.Unanswered++
					d.mu.Unlock()
				} else {
					for _, a := range answers {
						d.record(p, a)
					}
				}
				if p.cancel && ctx.Err() == nil && answers[0].status == http.StatusCreated {
					d.cancel(ctx, p)
				}
				if d.onOrder != nil {
					d.onOrder(int(d.sent.Add(1)))
				}
			}
		})
	}
	for i, p := range plan {
		if d.gate != nil {
			d.gate(ctx, i)
		}
		select {
		case work <- p:
		case <-ctx.Done():
			d.mu.Lock()
			d.res.Unanswered++ // never sent
			d.mu.Unlock()
		}
	}
	close(work)
	wg.Wait()
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.res
}

// cancel posts the order's cancellation twice (a client that retries), with
// the capacitat of its 201: both must answer 200 with the same body. A 503 or
// a network error is retried.
func (d *driver) cancel(ctx context.Context, p *planned) {
	d.mu.Lock()
	capability := d.res.caps[p.order.ID]
	d.mu.Unlock()
	var bodies []string
	for range 2 {
		for fails := 1; ; fails++ {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.url+"/comandes/"+p.order.ID+"/cancellacio", strings.NewReader(`{"motiu":"client"}`))
			if err != nil {
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Authorization", "Bearer "+capability)
			resp, err := d.client.Do(req)
			if err == nil {
				raw, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				d.mu.Lock()
				d.res.Requests++
				d.mu.Unlock()
				if resp.StatusCode == http.StatusOK {
					bodies = append(bodies, string(raw))
					break
				}
				if resp.StatusCode != http.StatusServiceUnavailable {
					d.mu.Lock()
					d.res.Unexpected++
					d.mu.Unlock()
					return
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(pause.Backoff(100*time.Millisecond, 2*time.Second, fails)):
			}
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.res.Cancelled++
	if bodies[0] != bodies[1] {
		d.res.CancelDiffers++
	}
}

// cancelLate cancels the planned late cancellations of the accepted orders.
func (d *driver) cancelLate(ctx context.Context, plan []*planned) int {
	n := 0
	for _, p := range plan {
		d.mu.Lock()
		_, ok := d.res.accepted[p.order.ID]
		d.mu.Unlock()
		if p.late && ok && ctx.Err() == nil {
			d.cancel(ctx, p)
			n++
		}
	}
	return n
}

// result returns the submissions so far.
func (d *driver) result() Submissions {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.res
}
