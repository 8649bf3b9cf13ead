package repartiment

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/km0/km0/internal/services/svc"
)

// ErrMapsUnavailable: the maps service answered 5xx or did not answer (transient).
var ErrMapsUnavailable = errors.New("mapes unavailable")

// Maps estimates a delivery; *MapsClient is the implementation.
type Maps interface {
	// Route returns the estimated minutes to deliver to city/postalCode. An
	// error wrapping ErrMapsUnavailable means "try again later".
	Route(ctx context.Context, orderID, city, postalCode string) (int, error)
}

// MapsServer is a simulated external maps service (GET /ruta) that can be told
// to answer 503 for chosen requests. attempt counts requests per order from 1.
type MapsServer struct {
	Fail     func(orderID string, attempt int) bool
	mu       sync.Mutex
	attempts map[string]int
	failed   int
}

// Handler returns GET /ruta?comanda=&ciutat=&codi_postal= → {"minuts": n}.
func (s *MapsServer) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		id := q.Get("comanda")
		s.mu.Lock()
		if s.attempts == nil {
			s.attempts = map[string]int{}
		}
		s.attempts[id]++
		fail := s.Fail != nil && s.Fail(id, s.attempts[id])
		if fail {
			s.failed++
		}
		s.mu.Unlock()
		if fail {
			svc.WriteError(w, http.StatusServiceUnavailable, svc.CodeUnavailable, "", "mapes unavailable (simulated)")
			return
		}
		minutes := 15 + len(q.Get("codi_postal"))*3 + len(q.Get("ciutat"))
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]int{"minuts": minutes})
	})
}

// Failed returns how many requests answered 503.
func (s *MapsServer) Failed() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed
}

// MapsClient calls a maps service over HTTP.
type MapsClient struct {
	BaseURL string
	Timeout time.Duration // default 2 s
	HTTP    *http.Client  // default http.DefaultClient
}

// Route implements Maps: 5xx, timeouts and connection errors wrap
// ErrMapsUnavailable; a 4xx is a plain error (the address is wrong).
func (c *MapsClient) Route(ctx context.Context, orderID, city, postalCode string) (int, error) {
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = 2 * time.Second
	}
	hc := c.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	q := url.Values{"comanda": {orderID}, "ciutat": {city}, "codi_postal": {postalCode}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.BaseURL+"/ruta?"+q.Encode(), nil)
	if err != nil {
		return 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, fmt.Errorf("%w: %v", ErrMapsUnavailable, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		return 0, fmt.Errorf("%w: HTTP %d", ErrMapsUnavailable, resp.StatusCode)
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("mapes: HTTP %d", resp.StatusCode)
	}
	var out struct {
		Minutes int `json:"minuts"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return 0, fmt.Errorf("%w: unreadable answer: %v", ErrMapsUnavailable, err)
	}
	return out.Minutes, nil
}
