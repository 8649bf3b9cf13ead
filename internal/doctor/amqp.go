package doctor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/amqp/amqplag"
)

// checkRabbitMQ checks the AMQP connection with its TLS, the management
// API (and the broker's clock through it), and the topology the deployment
// needs there: the events' exchange, queues, DLX and DLQs (by --events) and
// pagaments' authorisation queue (--authorize with request/reply over
// RabbitMQ).
func checkRabbitMQ(ctx context.Context, r *Report, cfg Config) {
	target := redact.URL(cfg.AMQPURL)
	tlsCfg, err := cfg.AMQPTLS()
	if err != nil {
		r.fail("rabbitmq connection", target, err.Error(), "fix the --amqp-tls-* file named")
		return
	}
	err = cfg.withTimeout(ctx, func(ctx context.Context) error {
		conn, err := amqp.Dial(ctx, amqp.Config{URL: cfg.AMQPURL, Name: "km0 doctor", Logger: cfg.Logger, TLS: tlsCfg})
		if err == nil {
			conn.Close()
		}
		return err
	})
	secure := strings.HasPrefix(cfg.AMQPURL, "amqps://")
	switch {
	case err != nil:
		r.fail("rabbitmq connection", target, scrubURL(err.Error(), cfg.AMQPURL),
			"check the user, password and virtual host of --amqp-url ($KM0_AMQP_URL), and for amqps:// --amqp-tls-ca-file and --amqp-tls-server-name")
		return
	case !secure && !loopback(amqpHost(cfg.AMQPURL)):
		r.warn("rabbitmq connection", target, "connected without TLS", "use amqps:// with --amqp-tls-ca-file: the password and the messages cross the network in clear")
	case secure:
		r.ok("rabbitmq connection", target, "connected over TLS, server certificate verified")
	default:
		r.ok("rabbitmq connection", target, "connected (no TLS, loopback)")
	}

	if cfg.ManagementURL == "off" {
		r.warn("rabbitmq management", target, "not checked (--amqp-management-url off)", "give the management API to check the broker's clock and the topology")
		return
	}
	mgmt, vhost, err := amqplag.ManagementURLFor(cfg.AMQPURL)
	if err != nil {
		r.fail("rabbitmq management", target, err.Error(), "fix --amqp-url")
		return
	}
	if cfg.ManagementURL != "" {
		mgmt = withUserOf(cfg.ManagementURL, mgmt)
	}
	m := &mgmtClient{base: mgmt, vhost: vhost, http: cfg.ManagementClient(tlsCfg)}
	mtarget := redact.URL(mgmt)
	before := time.Now()
	resp, err := m.get(ctx, "/api/overview")
	local := before.Add(time.Since(before) / 2)
	if err != nil {
		r.fail("rabbitmq management", mtarget, err.Error(),
			"enable the rabbitmq_management plugin, give --amqp-management-url when it listens elsewhere, and tag the user monitoring (km0 lag and the console read it)")
		return
	}
	r.ok("rabbitmq management", mtarget, "answers")
	if t, err := http.ParseTime(resp.Header.Get("Date")); err == nil {
		clockSkew(r, "rabbitmq clock", mtarget, t, local, time.Second, cfg.MaxSkew)
	}

	topo := system.EventsTopology(cfg.System)
	if cfg.Authorize && cfg.AMQPURL != "" {
		topo.Queues = append(topo.Queues, amqp.Queue{Name: pagaments.AuthQueue})
	}
	if len(topo.Queues) == 0 {
		return
	}
	checkTopology(ctx, r, m, topo)
}

// checkTopology reports every exchange, queue (with its dead-letter
// arguments) and binding of topo the broker lacks, or one ok row.
func checkTopology(ctx context.Context, r *Report, m *mgmtClient, topo amqp.Topology) {
	bad := 0
	vhost := url.PathEscape(m.vhost)
	topo = Dedup(topo)
	for _, e := range topo.Exchanges {
		if _, err := m.get(ctx, "/api/exchanges/"+vhost+"/"+url.PathEscape(e.Name)); err != nil {
			bad++
			r.fail("rabbitmq exchange", e.Name, err.Error(), "start the services once (each declares the topology at start), or declare the exchange "+e.Name)
		}
	}
	for _, q := range topo.Queues {
		var got struct {
			Arguments map[string]any `json:"arguments"`
		}
		if err := m.getJSON(ctx, "/api/queues/"+vhost+"/"+url.PathEscape(q.Name), &got); err != nil {
			bad++
			r.fail("rabbitmq queue", q.Name, err.Error(), "start the services once (each declares its queues at start, before any relay publishes)")
			continue
		}
		for _, k := range []string{amqp.ArgDeadLetterExchange, amqp.ArgDeadLetterRoutingKey} {
			if want, ok := q.Args[k]; ok && fmt.Sprint(got.Arguments[k]) != fmt.Sprint(want) {
				bad++
				r.fail("rabbitmq queue", q.Name, fmt.Sprintf("%s is %v, want %v", k, got.Arguments[k], want),
					"delete the queue once drained and let the service declare it again: RabbitMQ never changes a queue's arguments")
			}
		}
	}
	for _, b := range topo.Bindings {
		var got []struct {
			Key string `json:"routing_key"`
		}
		path := "/api/bindings/" + vhost + "/e/" + url.PathEscape(b.Exchange) + "/q/" + url.PathEscape(b.Queue)
		err := m.getJSON(ctx, path, &got)
		found := false
		for _, g := range got {
			found = found || g.Key == b.Key
		}
		if err != nil || !found {
			bad++
			r.fail("rabbitmq binding", b.Exchange+" -> "+b.Queue, "missing binding with key "+b.Key, "start the services once, or bind "+b.Queue+" to "+b.Exchange+" with key "+b.Key)
		}
	}
	if bad == 0 {
		r.ok("rabbitmq topology", m.vhost, fmt.Sprintf("%d exchanges, %d queues, %d bindings (DLX and DLQs included)", len(topo.Exchanges), len(topo.Queues), len(topo.Bindings)))
	}
}

// Dedup drops the repeated declarations a merged topology holds (each
// consumer's names the shared exchanges again).
func Dedup(t amqp.Topology) amqp.Topology {
	var out amqp.Topology
	seen := map[string]bool{}
	once := func(k string) bool {
		if seen[k] {
			return false
		}
		seen[k] = true
		return true
	}
	for _, e := range t.Exchanges {
		if once("e\x00" + e.Name) {
			out.Exchanges = append(out.Exchanges, e)
		}
	}
	for _, q := range t.Queues {
		if once("q\x00" + q.Name) {
			out.Queues = append(out.Queues, q)
		}
	}
	for _, b := range t.Bindings {
		if once("b\x00" + b.Exchange + "\x00" + b.Queue + "\x00" + b.Key) {
			out.Bindings = append(out.Bindings, b)
		}
	}
	return out
}

// mgmtClient reads the RabbitMQ management API; its errors never quote the
// URL, which holds the password.
type mgmtClient struct {
	base, vhost string
	http        *http.Client
}

func (m *mgmtClient) get(ctx context.Context, path string) (*http.Response, error) {
	base, err := url.Parse(m.base)
	if err != nil || base.Host == "" {
		return nil, errors.New("the management URL is not an absolute URL")
	}
	user := base.User
	base.User = nil
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(base.String(), "/")+path, nil)
	if err != nil {
		return nil, errors.New("the management URL is not an absolute URL")
	}
	if user != nil {
		pw, _ := user.Password()
		req.SetBasicAuth(user.Username(), pw)
	}
	resp, err := m.http.Do(req)
	if err != nil {
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusNotFound:
			return nil, errors.New("missing (404)")
		case http.StatusUnauthorized, http.StatusForbidden:
			return nil, fmt.Errorf("refused the user (%s)", resp.Status)
		}
		return nil, fmt.Errorf("answered %s", resp.Status)
	}
	return resp, nil
}

func (m *mgmtClient) getJSON(ctx context.Context, path string, v any) error {
	resp, err := m.get(ctx, path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	return json.NewDecoder(resp.Body).Decode(v)
}

// withUserOf returns u with the credentials of from when u has none.
func withUserOf(u, from string) string {
	pu, err := url.Parse(u)
	if err != nil || pu.User != nil {
		return u
	}
	if pf, err := url.Parse(from); err == nil {
		pu.User = pf.User
	}
	return pu.String()
}

// amqpHost is the host of an AMQP URL, "" when it does not parse.
func amqpHost(u string) string {
	pu, err := url.Parse(u)
	if err != nil {
		return ""
	}
	return pu.Hostname()
}

// scrubURL removes the password of u from s.
func scrubURL(s, u string) string {
	if pu, err := url.Parse(u); err == nil && pu.User != nil {
		if pw, ok := pu.User.Password(); ok {
			return scrub(s, pw)
		}
	}
	return s
}
