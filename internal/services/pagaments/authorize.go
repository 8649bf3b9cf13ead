package pagaments

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

// AuthRequest is the body of a request on pagaments.autoritzacions.
type AuthRequest struct {
	OrderID    string `json:"comanda_id"`
	TotalCents int64  `json:"import_centims"`
}

// AuthResponse is the answer.
type AuthResponse struct {
	OrderID  string `json:"comanda_id"`
	Approved bool   `json:"aprovada"`
	Reason   string `json:"motiu,omitempty"`
}

// Authorize answers one authorisation request: approved up to
// AuthLimitCents, refused above ("import_excessiu"). The decision is stored
// per order with the request's amount, so a repeated request (a requester
// that timed out and asked again) gets the same answer. A request for an
// order already decided for another amount is refused as a conflict
// (requestreply.Conflict, "conflict: ..."): it gets neither the other
// request's decision nor one of its own. It returns only after the decision
// is committed. Concurrent calls share their commits (see authBatcher). A
// malformed body, or a comanda_id that is empty, over
// requestreply.MaxIDBytesDefault bytes, not UTF-8 or with control
// characters, is outcome.Permanent, refused before any SQL.
func (s *Service) Authorize(ctx context.Context, body []byte) ([]byte, error) {
	var req AuthRequest
	if err := strictjson.Unmarshal(body, &req); err != nil {
		return nil, outcome.Permanentf("esquema: authorisation: %v", err)
	}
	if req.OrderID == "" || req.TotalCents < 0 {
		return nil, outcome.Permanentf("esquema: authorisation without comanda_id or with a negative import_centims")
	}
	// Bounded and checked before any SQL: a bad id is a clear refusal, never a database error.
	if err := requestreply.CheckID("esquema: authorisation: comanda_id", req.OrderID, maxOrderIDBytes); err != nil {
		return nil, err
	}
	c := &authCall{req: req, approved: req.TotalCents <= s.cfg.AuthLimitCents, done: make(chan struct{})}
	if !c.approved {
		c.reason = fmt.Sprintf("import_excessiu: %d > %d", req.TotalCents, s.cfg.AuthLimitCents)
	}
	if err := s.auth.do(ctx, c); err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		// The requester gets the class of failure, not PostgreSQL's text.
		if refusedInput(err) {
			return nil, outcome.Permanentf("esquema: authorisation: a comanda_id of %d bytes is not accepted", len(req.OrderID))
		}
		s.cfg.Logger.Warn("pagaments: authorisation not stored", "comanda_id", req.OrderID, "err", err)
		return nil, errors.New("pagaments: authorisation not stored (database); try again")
	}
	if c.stored.cents != req.TotalCents {
		// Another request (another amount) decided this order first: its
		// decision is not this request's answer. Nothing is stored for this
		// one, and the stored amount is not revealed.
		return nil, requestreply.Conflict(fmt.Errorf("conflict: order %s already holds an authorisation for another amount", req.OrderID))
	}
	return json.Marshal(AuthResponse{OrderID: req.OrderID, Approved: c.stored.approved, Reason: c.stored.reason})
}

// maxOrderIDBytes bounds comanda_id (tests raise it to reach PostgreSQL's own limits).
var maxOrderIDBytes = requestreply.MaxIDBytesDefault

// authCall is one Authorize waiting for its decision to be stored.
type authCall struct {
	req      AuthRequest
	approved bool   // this request's own decision
	reason   string // its motiu, "" if approved
	stored   decision
	err      error
	done     chan struct{}
}

// decision is a row of autoritzacions.
type decision struct {
	approved bool
	reason   string
	cents    int64
}

// authBatcher stores the decisions of concurrent Authorize calls together
// (group commit): while a batch is being written, the calls that arrive wait
// and go in the next one, one statement pipeline and one commit for all of
// them. A lone call goes at once, written by its caller, so latency is one
// commit when idle. At most authBatchesAtOnce batches run at a time (the lone
// call counts as one), so the pool keeps connections for the charging
// consumer. Each call still gets the decision stored for its
// order: the first decision committed wins, whichever batch or process wrote
// it.
type authBatcher struct {
	pool *pgxpool.Pool

	mu      sync.Mutex
	queue   []*authCall
	running int
}

const (
	authBatchMax      = 256
	authBatchesAtOnce = 2
	authBatchTimeout  = 10 * time.Second
)

func newAuthBatcher(pool *pgxpool.Pool) *authBatcher { return &authBatcher{pool: pool} }

// do queues c and waits until its decision is stored (or ctx ends: the
// decision may still be stored, and a retry reads it back). When no batch is
// being written, c is written at once by the calling goroutine.
func (b *authBatcher) do(ctx context.Context, c *authCall) error {
	b.mu.Lock()
	if b.running == 0 && len(b.queue) == 0 {
		// Idle: the call goes alone, written by its own goroutine (no
		// hand-off). Calls that arrive meanwhile start a batch of their own.
		b.running++
		b.mu.Unlock()
		wctx, cancel := context.WithTimeout(ctx, authBatchTimeout)
		b.store(wctx, []*authCall{c})
		cancel()
		b.mu.Lock()
		b.running--
		if len(b.queue) > 0 && b.running < authBatchesAtOnce {
			b.running++
			go b.run()
		}
		b.mu.Unlock()
		if c.err != nil && ctx.Err() != nil {
			return ctx.Err()
		}
		return c.err
	}
	b.queue = append(b.queue, c)
	if b.running < authBatchesAtOnce {
		b.running++
		go b.run()
	}
	b.mu.Unlock()
	select {
	case <-c.done:
		return c.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run writes batches until the queue is empty.
func (b *authBatcher) run() {
	for {
		b.mu.Lock()
		n := min(len(b.queue), authBatchMax)
		if n == 0 {
			b.running--
			b.mu.Unlock()
			return
		}
		batch := b.queue[:n:n]
		b.queue = b.queue[n:]
		if len(b.queue) == 0 {
			b.queue = nil // let the array go
		}
		b.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), authBatchTimeout)
		b.store(ctx, batch)
		cancel()
	}
}

// store writes batch and hands each call its stored decision. If the batch
// fails as a whole (one request PostgreSQL refuses, say), each call is tried
// alone, so one bad request fails only itself.
func (b *authBatcher) store(ctx context.Context, batch []*authCall) {
	err := b.write(ctx, batch)
	if err != nil && len(batch) > 1 && refusedInput(err) {
		for _, c := range batch {
			if err := b.write(ctx, []*authCall{c}); err != nil {
				c.err = err
			}
			close(c.done)
		}
		return
	}
	for _, c := range batch {
		c.err = err
		close(c.done)
	}
}

// write inserts the batch's decisions (the first per order; a stored one
// wins) and reads back the stored decision of every order, in one pipeline
// that PostgreSQL runs as one transaction. The read runs after the insert
// has waited out any concurrent writer of the same order, and sees what it
// committed.
func (b *authBatcher) write(ctx context.Context, batch []*authCall) error {
	if len(batch) == 1 {
		return b.writeOne(ctx, batch[0])
	}
	ids := make([]string, 0, len(batch))
	cents := make([]int64, 0, len(batch))
	approved := make([]bool, 0, len(batch))
	reasons := make([]*string, 0, len(batch))
	seen := make(map[string]bool, len(batch))
	for _, c := range batch {
		if seen[c.req.OrderID] {
			continue
		}
		seen[c.req.OrderID] = true
		ids = append(ids, c.req.OrderID)
		cents = append(cents, c.req.TotalCents)
		approved = append(approved, c.approved)
		var r *string
		if c.reason != "" {
			r = &c.reason
		}
		reasons = append(reasons, r)
	}
	var pb pgx.Batch
	pb.Queue(`INSERT INTO autoritzacions (comanda_id, import_centims, aprovada, motiu)
		SELECT * FROM unnest($1::text[], $2::bigint[], $3::bool[], $4::text[])
		ON CONFLICT (comanda_id) DO NOTHING`, ids, cents, approved, reasons)
	pb.Queue(`SELECT comanda_id, aprovada, coalesce(motiu, ''), import_centims FROM autoritzacions WHERE comanda_id = ANY($1::text[])`, ids)
	br := b.pool.SendBatch(ctx, &pb)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return fmt.Errorf("pagaments: store authorisations: %w", err)
	}
	rows, err := br.Query()
	if err != nil {
		return fmt.Errorf("pagaments: read authorisations: %w", err)
	}
	got := make(map[string]decision, len(ids))
	var id string
	var d decision
	if _, err := pgx.ForEachRow(rows, []any{&id, &d.approved, &d.reason, &d.cents}, func() error { got[id] = d; return nil }); err != nil {
		return fmt.Errorf("pagaments: read authorisations: %w", err)
	}
	if err := br.Close(); err != nil {
		return fmt.Errorf("pagaments: commit authorisations: %w", err)
	}
	for _, c := range batch {
		st, ok := got[c.req.OrderID]
		if !ok {
			return fmt.Errorf("pagaments: authorisation of %s not stored", c.req.OrderID)
		}
		c.stored = st
	}
	return nil
}

// writeOne is write for a lone call, in one statement: insert, or read back
// the stored decision. When a concurrent writer of the same order committed
// after the statement's snapshot, neither part sees a row: ask again (a new
// statement, a new snapshot).
func (b *authBatcher) writeOne(ctx context.Context, c *authCall) error {
	var reason *string
	if c.reason != "" {
		reason = &c.reason
	}
	var err error
	for range 3 {
		err = b.pool.QueryRow(ctx, `WITH nova AS (
				INSERT INTO autoritzacions (comanda_id, import_centims, aprovada, motiu) VALUES ($1, $2, $3, $4)
				ON CONFLICT (comanda_id) DO NOTHING RETURNING aprovada, motiu, import_centims)
			SELECT aprovada, coalesce(motiu, ''), import_centims FROM nova
			UNION ALL SELECT aprovada, coalesce(motiu, ''), import_centims FROM autoritzacions WHERE comanda_id = $1
			LIMIT 1`, c.req.OrderID, c.req.TotalCents, c.approved, reason).Scan(&c.stored.approved, &c.stored.reason, &c.stored.cents)
		if !errors.Is(err, pgx.ErrNoRows) {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("pagaments: store authorisation: %w", err)
	}
	return nil
}

// refusedInput reports an error PostgreSQL gives for one bad value (a data
// exception, class 22, or a program limit such as an over-long key, class 54).
func refusedInput(err error) bool {
	return pgerr.DataRefused(err)
}
