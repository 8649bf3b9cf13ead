// Package amqp is km0's RabbitMQ transport, on github.com/rabbitmq/amqp091-go:
// a connection manager that reconnects by itself and redeclares its topology
// (Conn), a confirmed Publisher with mandatory routing (transport.Publisher),
// a Consumer with manual acks after the effect's transaction, native
// dead-lettering and TTL wait queues for backoff, an ordered mode (N queues
// with single active consumer) and DLQ operations.
//
// Wire names follow CONTRACT.md: exchange km0.dlx, queues <queue>.dlq and
// <queue>.espera.<ms>, headers tipus, id_esdeveniment, intents, motiu.
package amqp

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/pause"
	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/transport"
)

// Defaults of Config.
const (
	URLDefault          = "amqp://guest:guest@127.0.0.1:5672/"
	ReconnectMinDefault = 100 * time.Millisecond
	ReconnectMaxDefault = 5 * time.Second
	HeartbeatDefault    = 10 * time.Second
)

// ErrBrokerUnavailable wraps the error of a first Dial that found no broker.
var ErrBrokerUnavailable = errors.New("amqp: RabbitMQ unavailable")

// ErrLoginRefused is the error of a first Dial whose user or password the
// broker refused (403 ACCESS_REFUSED): the broker answers, trying again
// will not help.
var ErrLoginRefused = errors.New("amqp: login refused")

// Config configures a Conn.
type Config struct {
	// URL of the broker. Default $KM0_AMQP_URL, else URLDefault. It is never
	// logged with its password.
	URL string
	// Name is shown in the management UI (connection_name). Default "km0".
	Name string
	// ReconnectMin and ReconnectMax bound the exponential wait between
	// reconnection attempts. Defaults 100 ms and 5 s.
	ReconnectMin, ReconnectMax time.Duration
	// Heartbeat is the AMQP heartbeat interval. Default 10 s.
	Heartbeat time.Duration
	// Logger receives reconnection events. Default slog.Default().
	Logger *slog.Logger
	// CoalesceWrites makes the frames that many goroutines send at once
	// (publishes, acks) leave in one write instead of one each: fewer
	// system calls here and fewer reads in the broker, for one goroutine
	// hand-off per write when idle. A returned Publish or Ack has then only
	// been queued; a write error closes the connection as before (it
	// heals). Default false.
	CoalesceWrites bool
	// TLS configures the connection of an amqps:// URL: the roots that
	// verify the broker, a client certificate, the server name (TLSFiles
	// builds one from files). Default nil: the URL's own TLS parameters
	// (cacertfile, certfile, keyfile, server_name_indication), else the
	// system's roots and the URL's host. Verification is never turned off
	// here. With an amqp:// URL, TLS is an error: the connection would
	// not be encrypted.
	TLS *tls.Config
}

// WithDefaults returns c with empty fields filled in.
func (c Config) WithDefaults() Config {
	if c.URL == "" {
		c.URL = os.Getenv("KM0_AMQP_URL")
	}
	if c.URL == "" {
		c.URL = URLDefault
	}
	if c.Name == "" {
		c.Name = "km0"
	}
	if c.ReconnectMin <= 0 {
		c.ReconnectMin = ReconnectMinDefault
	}
	if c.ReconnectMax < c.ReconnectMin {
		c.ReconnectMax = max(ReconnectMaxDefault, c.ReconnectMin)
	}
	if c.Heartbeat <= 0 {
		c.Heartbeat = HeartbeatDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Conn is one AMQP connection that heals itself. When the broker closes it or
// the network drops it (NotifyClose), a watcher goroutine dials again with
// exponential backoff, redeclares every Topology registered with Declare, and
// only then hands out channels again. Users hold channels, not the
// connection: when a channel dies they ask Channel for a new one, which waits
// until the connection is back. A Conn is safe for concurrent use.
type Conn struct {
	cfg    Config
	log    *slog.Logger
	closed chan struct{}
	ctx    context.Context // cancelled by Close: bounds reconnection dials
	cancel context.CancelFunc
	once   sync.Once
	done   chan struct{} // watcher exited

	mu      sync.Mutex
	conn    *amqp.Connection // nil while reconnecting
	changed chan struct{}    // closed and replaced whenever conn changes
	gen     uint64           // incremented on each successful connection
	topo    []Topology

	reconnects atomic.Int64
}

// Dial connects to the broker and starts the watcher. The first connection
// must succeed: a broker that does not answer is an error wrapping
// ErrBrokerUnavailable that names the URL without its password. Later
// failures are healed in the background until Close.
func Dial(ctx context.Context, cfg Config) (*Conn, error) {
	cfg = cfg.WithDefaults()
	if _, err := amqp.ParseURI(cfg.URL); err != nil {
		// url.Parse's error quotes the whole URL, password included: keep
		// only its reason.
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("amqp: invalid URL (not shown: it may hold a password): %w", err)
	}
	if u, _ := amqp.ParseURI(cfg.URL); cfg.TLS != nil && u.Scheme != "amqps" {
		return nil, fmt.Errorf("amqp: TLS settings given for a plain %s URL: use amqps:// (the connection would not be encrypted)", u.Scheme)
	}
	c := &Conn{cfg: cfg, log: cfg.Logger, closed: make(chan struct{}), done: make(chan struct{}), changed: make(chan struct{})}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	conn, err := c.dial(ctx)
	if err != nil {
		c.cancel()
		if ae := (*amqp.Error)(nil); errors.As(err, &ae) && ae.Code == amqp.AccessRefused {
			u, _ := amqp.ParseURI(cfg.URL)
			return nil, fmt.Errorf("%w: RabbitMQ at %s refused user %q (403 ACCESS_REFUSED: check the user and its password)", ErrLoginRefused, redact.URL(cfg.URL), u.Username)
		}
		if cfg.TLS != nil && len(cfg.TLS.Certificates) == 0 && cfg.TLS.GetClientCertificate == nil && errors.Is(err, amqp.ErrClosed) {
			// TLS 1.3 checks the client's certificate after the client's
			// side of the handshake: the broker's alert naming the cause
			// may be lost to the connection it closes.
			return nil, fmt.Errorf("%w at %s: %w (the broker closed the TLS connection at once: it may require a client certificate, and none is configured)",
				ErrBrokerUnavailable, redact.URL(cfg.URL), err)
		}
		return nil, fmt.Errorf("%w at %s: %w", ErrBrokerUnavailable, redact.URL(cfg.URL), err)
	}
	c.install(conn)
	go c.watch(conn)
	return c, nil
}

func (c *Conn) dial(ctx context.Context) (*amqp.Connection, error) {
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(c.cfg.Name)
	type result struct {
		conn *amqp.Connection
		err  error
	}
	ch := make(chan result, 1)
	go func() {
		dial := amqp.DefaultDial(5 * time.Second)
		if c.cfg.CoalesceWrites {
			plain := dial
			dial = func(network, addr string) (net.Conn, error) {
				nc, err := plain(network, addr)
				if err != nil {
					return nil, err
				}
				return newCoalescingConn(nc), nil
			}
		}
		// DialConfig fills in the server name of the TLS configuration it
		// is given: a copy for each dial.
		var tlsCfg *tls.Config
		if c.cfg.TLS != nil {
			tlsCfg = c.cfg.TLS.Clone()
		}
		conn, err := amqp.DialConfig(c.cfg.URL, amqp.Config{Heartbeat: c.cfg.Heartbeat, Properties: props, Dial: dial, TLSClientConfig: tlsCfg})
		ch <- result{conn, err}
	}()
	select {
	case r := <-ch:
		return r.conn, r.err
	case <-ctx.Done():
		go func() {
			if r := <-ch; r.conn != nil {
				_ = r.conn.Close()
			}
		}()
		return nil, ctx.Err()
	}
}

// install makes conn the current connection and wakes every waiter.
func (c *Conn) install(conn *amqp.Connection) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.conn = conn
	if conn != nil {
		c.gen++
	}
	close(c.changed)
	c.changed = make(chan struct{})
}

// watch waits for the connection to close and reconnects, until Close.
func (c *Conn) watch(conn *amqp.Connection) {
	defer close(c.done)
	for {
		notify := conn.NotifyClose(make(chan *amqp.Error, 1))
		var cause *amqp.Error
		select {
		case cause = <-notify:
		case <-c.closed:
			_ = conn.Close()
			return
		}
		c.install(nil)
		c.log.Warn("amqp: connection lost; reconnecting", "url", redact.URL(c.cfg.URL), "cause", errString(cause))
		conn = c.reconnect()
		if conn == nil {
			return // closed while reconnecting
		}
		c.reconnects.Add(1)
		c.install(conn)
		c.log.Info("amqp: reconnected and topology redeclared", "url", redact.URL(c.cfg.URL))
	}
}

func errString(e *amqp.Error) string {
	if e == nil {
		return "closed"
	}
	return e.Error()
}

// backoff is the wait before the next dial or subscription after the
// failures-th in a row: ReconnectMin doubling to ReconnectMax, jittered, so
// the connections and consumers an outage broke together do not come back in
// lockstep.
func (c *Conn) backoff(failures int) time.Duration {
	return pause.Backoff(c.cfg.ReconnectMin, c.cfg.ReconnectMax, failures)
}

// reconnect dials until it has a connection on which every registered
// topology was redeclared, or until Close (then it returns nil).
func (c *Conn) reconnect() *amqp.Connection {
	wait := c.backoff(1)
	for fails := 1; ; fails++ {
		select {
		case <-c.closed:
			return nil
		case <-time.After(wait):
		}
		wait = c.backoff(fails + 1)
		ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
		conn, err := c.dial(ctx)
		if err != nil {
			cancel()
			c.log.Debug("amqp: reconnect attempt failed", "err", err)
			continue
		}
		err = c.redeclare(ctx, conn)
		cancel()
		if err != nil {
			_ = conn.Close()
			// The broker is up but refuses the topology (e.g. a queue
			// recreated with other arguments: PRECONDITION_FAILED). It will
			// not heal by itself, and nothing flows meanwhile: an error,
			// naming the entity and the broker's reason, at every attempt.
			c.log.Error("amqp: reconnected but cannot declare the topology again; retrying", "url", redact.URL(c.cfg.URL),
				"err", err, "retry_in", wait)
			continue
		}
		return conn
	}
}

// redeclare applies every registered topology on a fresh channel of conn.
func (c *Conn) redeclare(ctx context.Context, conn *amqp.Connection) error {
	c.mu.Lock()
	topo := append([]Topology(nil), c.topo...)
	c.mu.Unlock()
	if len(topo) == 0 {
		return nil
	}
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close() //nolint:errcheck // best effort
	for _, t := range topo {
		if err := t.apply(ctx, ch); err != nil {
			return err
		}
	}
	return nil
}

// redeclareQueue applies again every registered Topology that declares
// queue, for a queue deleted while in use. It reports whether there was one.
func (c *Conn) redeclareQueue(ctx context.Context, queue string) (bool, error) {
	c.mu.Lock()
	var topo []Topology
	for _, t := range c.topo {
		if slices.Contains(t.QueueNames(), queue) {
			topo = append(topo, t)
		}
	}
	c.mu.Unlock()
	if len(topo) == 0 {
		return false, nil
	}
	return true, c.Do(ctx, func(ch *amqp.Channel) error {
		for _, t := range topo {
			if err := t.apply(ctx, ch); err != nil {
				return err
			}
		}
		return nil
	})
}

// Channel opens a channel on the current connection. While the connection is
// being re-established it waits, until ctx ends (returning ctx.Err()) or the
// Conn is closed (transport.ErrClosed).
func (c *Conn) Channel(ctx context.Context) (*amqp.Channel, error) {
	for {
		c.mu.Lock()
		conn, changed := c.conn, c.changed
		c.mu.Unlock()
		select {
		case <-c.closed:
			return nil, ErrConnClosed
		default:
		}
		if conn != nil {
			ch, err := conn.Channel()
			if err == nil {
				return ch, nil
			}
			if !conn.IsClosed() {
				return nil, fmt.Errorf("amqp: open channel: %w", err)
			}
			// The watcher has not noticed yet; wait for it.
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-c.closed:
			return nil, ErrConnClosed
		case <-time.After(c.cfg.ReconnectMin):
		}
	}
}

// Do runs fn on a short-lived channel (opened with Channel and closed after).
// An error from fn is returned as it is.
func (c *Conn) Do(ctx context.Context, fn func(ch *amqp.Channel) error) error {
	ch, err := c.Channel(ctx)
	if err != nil {
		return err
	}
	defer ch.Close() //nolint:errcheck // a failed fn may have closed it already
	return fn(ch)
}

// Declare applies t now and registers it, so that it is declared again after
// every reconnection. An error (for instance a queue that exists with other
// arguments: PRECONDITION_FAILED) leaves t unregistered.
func (c *Conn) Declare(ctx context.Context, t Topology) error {
	if err := c.Do(ctx, func(ch *amqp.Channel) error { return t.apply(ctx, ch) }); err != nil {
		return err
	}
	c.mu.Lock()
	c.topo = append(c.topo, t)
	c.mu.Unlock()
	return nil
}

// generation counts successful connections (1 after Dial); it changes when
// the connection was replaced.
func (c *Conn) generation() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen
}

// Reconnects returns how many times the connection was re-established.
func (c *Conn) Reconnects() int64 { return c.reconnects.Load() }

// Close closes the connection and stops reconnecting. Channels obtained from
// it are closed. Close is idempotent.
func (c *Conn) Close() error {
	c.once.Do(func() {
		close(c.closed)
		c.cancel()
	})
	<-c.done
	return nil
}

// ErrConnClosed is returned by a Conn (and what uses it) after Close. It
// wraps transport.ErrClosed.
var ErrConnClosed = fmt.Errorf("amqp: connection closed: %w", transport.ErrClosed)
