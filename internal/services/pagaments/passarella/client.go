package passarella

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"
)

// Errors of Client.Charge.
var (
	// ErrUnavailable: the gateway answered 5xx, refused the API key (401,
	// 403: km0's configuration) or did not answer in time. Retrying with the
	// same key is safe (transient).
	ErrUnavailable = errors.New("passarella unavailable")
	// ErrRefused: the gateway refused the request (4xx). Retrying cannot help.
	ErrRefused = errors.New("passarella: request refused")
)

// TimeoutDefault bounds one Charge call.
const TimeoutDefault = 2 * time.Second

// Client calls a gateway.
type Client struct {
	BaseURL string        // e.g. http://127.0.0.1:8089
	APIKey  string        // sent as "Authorization: Bearer"; Server.APIKey, or the external gateway's key
	Timeout time.Duration // per call; default TimeoutDefault
	HTTP    *http.Client  // default http.DefaultClient
}

// Charge asks the gateway to charge totalCents for orderID under key (the
// Idempotency-Key) and returns the charge. A timeout or 5xx wraps
// ErrUnavailable; a 4xx wraps ErrRefused.
func (c *Client) Charge(ctx context.Context, key, orderID string, totalCents int64) (Charge, error) {
	raw, err := c.post(ctx, "/cobraments", key, ChargeRequest{OrderID: orderID, TotalCents: totalCents})
	if err != nil {
		return Charge{}, err
	}
	var ch Charge
	if err := json.Unmarshal(raw, &ch); err != nil || ch.Ref == "" {
		return Charge{}, fmt.Errorf("%w: unreadable answer", ErrUnavailable)
	}
	return ch, nil
}

// post sends body to path with the Idempotency-Key and returns the 2xx body.
func (c *Client) post(ctx context.Context, path, key string, body any) ([]byte, error) {
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = TimeoutDefault
	}
	hc := c.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+path, bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrRefused, err)
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	if c.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.APIKey)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	switch {
	case resp.StatusCode >= 500:
		return nil, fmt.Errorf("%w: HTTP %d", ErrUnavailable, resp.StatusCode)
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		// km0's configuration, not the customer's card: retried, never
		// dead-lettered as a refused card.
		return nil, fmt.Errorf("%w: HTTP %d: the gateway refused km0's API key (check $%s)", ErrUnavailable, resp.StatusCode, APIKeyEnv)
	case resp.StatusCode >= 400:
		return nil, fmt.Errorf("%w: HTTP %d %s", ErrRefused, resp.StatusCode, bytes.TrimSpace(raw))
	}
	return raw, nil
}
