package lag

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// queueStats is what the management API tells of a queue.
// Its counts are sampled by the broker (every 5 s by default); a queue it has
// not sampled yet has none (nil).
type queueStats struct {
	Unacked *int `json:"messages_unacknowledged"`
}

// management reads GET /api/queues/{vhost}/{queue} of the management API.
// Errors never quote the URL (it holds the password).
func (m *Measurer) management(ctx context.Context, queue string) (queueStats, error) {
	base, err := url.Parse(m.cfg.ManagementURL)
	if err != nil || base.Host == "" {
		return queueStats{}, fmt.Errorf("lag: management URL is not an absolute URL")
	}
	user := base.User
	base.User = nil
	u := strings.TrimSuffix(base.String(), "/") + "/api/queues/" + url.PathEscape(m.cfg.VHost) + "/" + url.PathEscape(queue)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return queueStats{}, fmt.Errorf("lag: management request: %w", err)
	}
	if user != nil {
		pw, _ := user.Password()
		req.SetBasicAuth(user.Username(), pw)
	}
	resp, err := m.cfg.HTTPClient.Do(req)
	if err != nil {
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			err = ue.Err
		}
		return queueStats{}, fmt.Errorf("lag: management API: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return queueStats{}, fmt.Errorf("lag: management API answered %s", resp.Status)
	}
	var st queueStats
	if err := json.NewDecoder(http.MaxBytesReader(nil, resp.Body, 1<<20)).Decode(&st); err != nil {
		return queueStats{}, fmt.Errorf("lag: management API: %w", err)
	}
	return st, nil
}
