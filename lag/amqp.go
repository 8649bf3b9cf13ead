package lag

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/transport/amqp"
)

type amqpChannel = amqp091.Channel

// Ports of the RabbitMQ management API when enabled with its defaults
// (rabbitmq-plugins enable rabbitmq_management).
const (
	ManagementPort    = 15672
	ManagementTLSPort = 15671
)

// ManagementURLFor returns the management API a broker at amqpURL has when
// the plugin runs with its default listener: the same host and credentials,
// http on port 15672 (https on 15671 for amqps), and the URL's virtual host.
// amqpURL "" is amqp.URLDefault. It is a guess: the plugin may be disabled
// or listen elsewhere (Config.ManagementBestEffort).
func ManagementURLFor(amqpURL string) (mgmt, vhost string, err error) {
	if amqpURL == "" {
		amqpURL = amqp.URLDefault
	}
	u, err := amqp091.ParseURI(amqpURL)
	if err != nil {
		return "", "", errors.New("lag: the RabbitMQ URL does not parse") // never quote it: it holds the password
	}
	scheme, port := "http", ManagementPort
	if u.Scheme == "amqps" {
		scheme, port = "https", ManagementTLSPort
	}
	m := url.URL{Scheme: scheme, Host: net.JoinHostPort(u.Host, strconv.Itoa(port)), User: url.UserPassword(u.Username, u.Password)}
	return m.String(), u.Vhost, nil
}

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
