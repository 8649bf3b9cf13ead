package comandes

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/km0/km0/internal/pause"
	"github.com/km0/km0/internal/services/svc"
)

// KeyLeaseDefault is how long a request holds its Idempotency-Key while it
// runs (Config.KeyLease): twice the request/reply timeout of the
// authorisation (requestreply.TimeoutDefault, 5 s).
const KeyLeaseDefault = 10 * time.Second

// claimSQL makes the caller the holder of a key: it inserts the key in
// progress (estat_http = 0), or takes over a claim whose holder's lease has
// passed without an answer (the holder died). It returns no row when another
// request holds the key or has answered under it.
const claimSQL = `INSERT INTO peticions_idempotents AS p (clau, hash_peticio, estat_http, resposta, titular, reservada_fins)
	VALUES ($1, $2, 0, 'null', $3, now() + $4::interval)
	ON CONFLICT (clau) DO UPDATE SET hash_peticio = EXCLUDED.hash_peticio, titular = EXCLUDED.titular,
		reservada_fins = EXCLUDED.reservada_fins, creat_en = now()
	WHERE p.estat_http = 0 AND p.reservada_fins < now()
	RETURNING true`

// Bounds of the wait of a request whose key another request holds: it polls
// the key (from waitMin, doubling up to waitMax) and wakes at once when the
// holder runs in this process.
const (
	waitMin = 2 * time.Millisecond
	waitMax = 100 * time.Millisecond
)

// errKeyLost: the lease of this request's claim passed and another request
// took the key over; the answer is theirs.
var errKeyLost = errors.New("comandes: idempotency key taken over")

// flights wakes the requests of this process that wait for a key held here.
type flights struct {
	mu sync.Mutex
	m  map[string]chan struct{}
}

// start registers key as held here and returns the function that wakes its
// waiters when the holder is done.
func (f *flights) start(key string) (done func()) {
	ch := make(chan struct{})
	f.mu.Lock()
	if f.m == nil {
		f.m = map[string]chan struct{}{}
	}
	f.m[key] = ch
	f.mu.Unlock()
	return func() {
		f.mu.Lock()
		if f.m[key] == ch {
			delete(f.m, key)
		}
		f.mu.Unlock()
		close(ch)
	}
}

// wake returns a channel closed when this process's holder of key is done,
// or nil when no request here holds it.
func (f *flights) wake(key string) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.m[key]
}

// claim returns this request's token once it holds key, or, when another
// request answered under the key (or used it with another body), that answer.
// While another live request holds the key it waits, until that request
// answers, gives the key up, or its lease passes, or ctx ends.
// A replayed 201 carries the capability again, opened with the key and body.
func (s *Service) claim(ctx context.Context, key, bodyHash string, reqBody []byte) (token string, a answer, answered bool, err error) {
	token = newToken()
	lease := fmt.Sprintf("%d microseconds", s.cfg.KeyLease.Microseconds())
	for fails := 1; ; fails++ {
		wait := pause.Backoff(waitMin, waitMax, fails)
		var held bool
		err := s.cfg.Pool.QueryRow(ctx, claimSQL, key, bodyHash, token, lease).Scan(&held)
		if err == nil {
			return token, answer{}, false, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return "", answer{}, false, err
		}
		var (
			status  int
			body    []byte
			hash    string
			expired bool
			sealed  []byte
		)
		err = s.cfg.Pool.QueryRow(ctx, `SELECT estat_http, resposta, hash_peticio, coalesce(reservada_fins < now(), false), capacitat_xifrada
			FROM peticions_idempotents WHERE clau = $1`, key).Scan(&status, &body, &hash, &expired, &sealed)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			continue // the holder gave the key up (no answer to keep): claim it
		case err != nil:
			return "", answer{}, false, err
		case hash != bodyHash:
			return "", answer{Status: 422, Body: errorBody(svc.CodeIdempotencyKeyReused, "Idempotency-Key", "the key was already used with another body")}, true, nil
		case status > 0:
			if status == 201 && sealed != nil {
				c, err := openCapability(key, reqBody, sealed)
				if err != nil { // cannot happen: the body's hash matched
					s.cfg.Logger.Warn("comandes: replay without its capability: it does not open", "err", err)
				}
				body = withCapability(body, c)
			}
			return "", answer{Status: status, Body: body, Replay: true}, true, nil
		case expired:
			continue // its holder died: take it over
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return "", answer{}, false, ctx.Err()
		case <-s.flights.wake(key):
			t.Stop()
		case <-t.C:
		}
	}
}

// createKeyed is create with an Idempotency-Key: the key is claimed first, in
// its own short transaction, so that every later request with it waits for
// this one's answer and replays it. The claim holds no connection while
// pagaments is asked. A 201 and a 402 are stored under the key; a 409 (a
// taken id, or an authorisation conflict), a 503 and any failure give the key up, so a retry runs afresh. A claim left by a
// process that died is taken over once its lease (Config.KeyLease) passes.
func (s *Service) createKeyed(ctx context.Context, o *Order, key string, reqBody []byte) (answer, error) {
	bodyHash := hashBody(reqBody)
	for {
		token, a, answered, err := s.claim(ctx, key, bodyHash, reqBody)
		if err != nil || answered {
			return a, err
		}
		a, err = s.createHolding(ctx, o, key, bodyHash, token, reqBody)
		if !errors.Is(err, errKeyLost) {
			return a, err
		}
		// Too slow: another request took the key over. Wait for its answer.
	}
}

// createHolding runs the request that holds key with token, within its lease.
// The 201 is stored without its capability, which is stored sealed
// (sealCapability) beside it.
func (s *Service) createHolding(ctx context.Context, o *Order, key, bodyHash, token string, reqBody []byte) (_ answer, err error) {
	done := s.flights.start(key)
	defer done()
	stored := false
	defer func() {
		if !stored {
			s.release(ctx, key, token)
		}
	}()
	// Past its lease another request may take the key over: stop by then.
	ctx, cancel := context.WithTimeout(ctx, s.cfg.KeyLease)
	defer cancel()
	if s.cfg.Authorizer != nil {
		if err := s.checkFree(ctx, o.ID); err != nil {
			return answer{}, err
		}
		if err := s.cfg.Authorizer.Authorize(ctx, o.ID, o.Total()); err != nil {
			if errors.Is(err, ErrAuthConflict) {
				return answer{}, err // a 409, never stored under the key
			}
			if !errors.Is(err, ErrRefused) {
				return answer{}, fmt.Errorf("%w: %w", errUnavailable, err)
			}
			body := errorBody(svc.CodePaymentRefused, "targeta", "payment refused: "+err.Error())
			// The answer is given as stored (JSONB's text), byte for byte what a retry gets.
			err := s.cfg.Pool.QueryRow(ctx, `UPDATE peticions_idempotents SET estat_http = 402, resposta = $3
				WHERE clau = $1 AND titular = $2 AND estat_http = 0 RETURNING resposta`, key, token, string(body)).Scan(&body)
			if errors.Is(err, pgx.ErrNoRows) {
				return answer{}, errKeyLost
			}
			if err != nil {
				return answer{}, err
			}
			stored = true
			return answer{Status: 402, Body: body}, nil
		}
	}
	tx, err := s.cfg.Pool.Begin(ctx)
	if err != nil {
		return answer{}, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	// Lock the claim: a takeover now waits for this transaction and then
	// finds the key answered.
	var one int
	err = tx.QueryRow(ctx, `SELECT 1 FROM peticions_idempotents WHERE clau = $1 AND titular = $2 AND estat_http = 0 FOR UPDATE`, key, token).Scan(&one)
	if errors.Is(err, pgx.ErrNoRows) {
		return answer{}, errKeyLost
	}
	if err != nil {
		return answer{}, err
	}
	body, capability, err := s.insert(ctx, tx, o)
	if err != nil {
		return answer{}, err
	}
	if err := tx.QueryRow(ctx, `UPDATE peticions_idempotents SET estat_http = 201, resposta = $2, capacitat_xifrada = $3 WHERE clau = $1
		RETURNING resposta`, key, string(body), sealCapability(key, reqBody, capability)).Scan(&body); err != nil {
		return answer{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return answer{}, err // if it did commit, release below deletes nothing (estat_http is 201)
	}
	stored = true
	return answer{Status: 201, Body: withCapability(body, capability)}, nil
}

// release gives up the claim of key (no answer was stored under it), so that
// a retry runs afresh. If that fails the claim is taken over once its lease
// passes.
func (s *Service) release(ctx context.Context, key, token string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := s.cfg.Pool.Exec(ctx, `DELETE FROM peticions_idempotents WHERE clau = $1 AND titular = $2 AND estat_http = 0`, key, token); err != nil {
		s.cfg.Logger.Warn("comandes: release idempotency key; a retry waits for its lease", "lease", s.cfg.KeyLease, "err", err)
	}
}

// checkFree returns errDuplicateID when an order with id exists: a taken id is
// a 409, not whatever the authoriser says about it (pagaments refuses another
// amount for an order it approved).
func (s *Service) checkFree(ctx context.Context, id string) error {
	var taken bool
	if err := s.cfg.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM comandes WHERE id = $1)`, id).Scan(&taken); err != nil {
		return err
	}
	if taken {
		return errDuplicateID
	}
	return nil
}

func newToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
