package system

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/km0/km0/internal/hostguard"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/buildinfo"
	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/schema"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

// Names of the auxiliary HTTP servers in Config.HTTPAddrs and System.Addrs.
const (
	GatewayName = "passarella"
	MapsName    = "mapes"
)

// System is a running set of services. Its exported service fields are nil
// for services not started.
type System struct {
	cfg    Config
	log    *slog.Logger
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	pools   map[string]*pgxpool.Pool // by database name (service, or service+"-side")
	dbNames map[string]string        // service → database name
	kcl     *kgo.Client              // nil when Kafka carries nothing
	pub     *kafka.Publisher         // the relays' publisher of the events on Kafka
	events  *amqp.Conn               // the events' connection to RabbitMQ; nil when none travels there
	amqpPub *amqp.Publisher          // the relays' publisher of the events on RabbitMQ
	reasons reasons                  // motius of the permanent dead letters over RabbitMQ
	servers []*http.Server
	addrs   map[string]string

	Comandes    *comandes.Service
	Inventari   *inventari.Service
	Pagaments   *pagaments.Service
	Repartiment *repartiment.Service
	Analitica   *analitica.Service
	Cataleg     *cataleg.Service
	Gateway     *passarella.Server
	Maps        *repartiment.MapsServer

	pause   pauses // the operator's pause switches of the consumer groups
	sup     supervisor
	rr      *rrStack
	schemas *schema.Registry
}

// Start creates and migrates the databases of the chosen services, ensures
// the topics, and starts relays, consumers, request/reply servers and HTTP
// APIs. They run until ctx ends or Close is called. On error everything
// started so far is stopped.
func Start(ctx context.Context, cfg Config) (_ *System, err error) {
	if err := cfg.validateEvents(); err != nil {
		return nil, err
	}
	if len(cfg.Services) == 0 {
		cfg.Services = Services
	}
	for _, s := range cfg.Services {
		if !slices.Contains(Services, s) {
			return nil, fmt.Errorf("unknown service %q (known: %s)", s, strings.Join(Services, ", "))
		}
		if cfg.DatabaseURL == "" && cfg.DatabaseURLs[s] == "" {
			return nil, fmt.Errorf("%s has no database: Config.DatabaseURL (an admin URL) or Config.DatabaseURLs[%q] is required", s, s)
		}
	}
	if cfg.RelayMode != "" && cfg.RelayMode != RelayPolling && cfg.RelayMode != RelayCDC {
		return nil, fmt.Errorf("Config.RelayMode %q: want %q or %q", cfg.RelayMode, RelayPolling, RelayCDC)
	}
	switch cfg.OutboxMode {
	case "", outbox.ModeTable:
	case outbox.ModeWAL:
		switch {
		case cfg.RelayMode == RelayPolling:
			return nil, fmt.Errorf("Config.OutboxMode %q is streamed by the CDC relay, not RelayMode %q", cfg.OutboxMode, cfg.RelayMode)
		case cfg.RelayPruneOlderThan != 0 || cfg.RelayDeletePublished:
			return nil, fmt.Errorf("Config.OutboxMode %q has no outbox rows: RelayPruneOlderThan and RelayDeletePublished do not apply", cfg.OutboxMode)
		}
		cfg.RelayMode = RelayCDC
	default:
		return nil, fmt.Errorf("Config.OutboxMode %q: want %q or %q", cfg.OutboxMode, outbox.ModeTable, outbox.ModeWAL)
	}
	if cfg.RelayPruneOlderThan < 0 {
		return nil, fmt.Errorf("Config.RelayPruneOlderThan %v is negative (0 turns pruning off)", cfg.RelayPruneOlderThan)
	}
	if err := cfg.validateNames(); err != nil {
		return nil, err
	}
	cfg.GatewayAPIKey = cmp.Or(cfg.GatewayAPIKey, os.Getenv(passarella.APIKeyEnv))
	if cfg.SigningKey == nil {
		cfg.SigningKey = requestreply.SigningKeyFromEnv()
	}
	if err := cfg.validateRR(); err != nil {
		return nil, err
	}
	cfg.MaxConns = cmp.Or(cfg.MaxConns, MaxConnsDefault)
	cfg.AssignInterval = cmp.Or(cfg.AssignInterval, AssignIntervalDefault)
	cfg.PurgeInterval = cmp.Or(cfg.PurgeInterval, PurgeIntervalDefault)
	cfg.KeyRetention = cmp.Or(cfg.KeyRetention, inbox.RetentionDefault)
	cfg.RequestKeyRetention = cmp.Or(cfg.RequestKeyRetention, RequestKeyRetentionDefault)
	cfg.RestartDelay = cmp.Or(cfg.RestartDelay, 200*time.Millisecond)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s := &System{cfg: cfg, log: cfg.Logger, ctx: runCtx, cancel: cancel, pools: map[string]*pgxpool.Pool{},
		dbNames: map[string]string{}, addrs: map[string]string{}}
	s.sup.init(s)
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	// Stop when the caller's context ends.
	go func() {
		select {
		case <-ctx.Done():
			s.cancel()
		case <-runCtx.Done():
		}
	}()
	if s.schemas, err = schema.Default(); err != nil {
		return nil, err
	}
	if cfg.onKafka() {
		if s.kcl, err = kafka.NewClient(cfg.Brokers, cfg.KafkaOpts...); err != nil {
			return nil, err
		}
		s.pub = kafka.NewPublisher(s.kcl)
		var specs []kafka.TopicSpec
		for _, t := range cfg.kafkaTopics() {
			specs = append(specs, cfg.TopicSettings.Spec(t, kafka.PartitionsDefault))
		}
		if err := kafka.EnsureTopicSpecs(ctx, s.kcl, s.log, specs...); err != nil {
			return nil, fmt.Errorf("topics: %w", err)
		}
	}
	if cfg.onRabbitMQ() {
		if err := s.startEvents(ctx); err != nil {
			return nil, err
		}
	}
	if s.rr, err = newRR(ctx, s); err != nil {
		return nil, err
	}
	for _, name := range cfg.Services {
		if err := s.startService(ctx, name); err != nil {
			// One prefix, the service's: the caller adds its own (km0 up:).
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	s.watchPauses()
	return s, nil
}

// open opens and migrates the database of service: its own
// (Config.DatabaseURLs) as is, or km0_<service> on the admin URL's server,
// created if absent.
func (s *System) open(ctx context.Context, service string, maxConns int32, sets ...migrate.Set) (*pgxpool.Pool, error) {
	u := s.cfg.DatabaseURLs[service]
	if u == "" {
		var err error
		if u, err = svc.EnsureDatabase(ctx, s.cfg.DatabaseURL, svc.DatabaseName(service, s.cfg.DatabaseSuffix)); err != nil {
			return nil, err
		}
	}
	pool, err := svc.OpenPool(ctx, u, maxConns)
	if err != nil {
		return nil, err
	}
	name := pool.Config().ConnConfig.Database
	s.pools[service] = pool
	s.dbNames[service] = name
	s.log.Info("system: database", "service", service, "database", redact.URL(u))
	if err := svc.Migrate(ctx, pool, append(sets, consumer.PauseMigrations)...); err != nil {
		return nil, fmt.Errorf("migrate %s: %w", name, err)
	}
	if s.cfg.OutboxMode == outbox.ModeWAL && slices.Contains(sets, migrate.Outbox) {
		// Before the service exists: no event without its slot.
		if _, err := migrate.EnsureWALSlot(ctx, pool, migrate.WALSlot(name, migrate.Names{}), ""); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	return pool, nil
}

// topic returns the name of contract topic t (Config.Topics).
func (s *System) topic(t string) string { return cmp.Or(s.cfg.Topics[t], t) }

// HTTPWriteTimeoutDefault bounds the time from the end of a request's
// headers to the end of its answer on every HTTP server Start runs: a
// client that stops reading, or a handler that hangs, holds a connection no
// longer than this. It exceeds the longest a handler waits by design
// (comandes waiting for a concurrent request with the same
// Idempotency-Key, or for an authorisation).
const HTTPWriteTimeoutDefault = 30 * time.Second

// serve starts an HTTP server for h on the configured address of name,
// answering only the Host names svc.HostGuard allows for its address and
// Config.AllowedHosts.
func (s *System) serve(name string, h http.Handler) error {
	addr := cmp.Or(s.cfg.HTTPAddrs[name], "127.0.0.1:0")
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen %s for %s: %w", addr, name, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET "+HealthPath, s.health(name, s.pools[name])) // read here: Start is still adding pools
	mux.Handle("/", h)
	srv := s.httpServer(addr, l.Addr(), mux)
	s.servers = append(s.servers, srv)
	s.addrs[name] = "http://" + l.Addr().String()
	s.wg.Go(func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("system: http server", "name", name, "err", err)
		}
	})
	return nil
}

// HealthPath is the health endpoint of every HTTP server Start runs: 200
// {"servei": name, "estat": "ok"} while the service's database answers a
// ping within HealthTimeout, else 503 with a short reason in English, for
// people (no internals): "stopping" once the system shuts down, "the
// database does not answer". Probes read the status code; only "ok" is
// stable.
const HealthPath = "/salut"

// HealthTimeout bounds the database ping of a health check.
const HealthTimeout = 2 * time.Second

// Health is the body of HealthPath.
type Health struct {
	Service string `json:"servei"`
	State   string `json:"estat"` // "ok", or why not (English, for people)
	// UnsignedRequests: the process serves or asks for authorisations
	// without a signing key (Config.AcceptUnsignedRequests); absent otherwise.
	UnsignedRequests bool `json:"peticions_sense_signar,omitempty"`
	// Version is the binary's module version and commit
	// (buildinfo.Info.Short, the short form of `km0 version`).
	Version string `json:"versio"`
	// Paused are the service's consumer groups an operator paused (they
	// take no new batch); a paused service is still healthy.
	Paused []string `json:"pausats,omitempty"`
}

func (s *System) health(name string, pool *pgxpool.Pool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, code := Health{Service: name, State: "ok", Version: buildinfo.Read().Short(), UnsignedRequests: s.rr != nil && s.rr.unsigned(), Paused: s.Paused(name)}, http.StatusOK
		if s.ctx.Err() != nil {
			h.State, code = "stopping", http.StatusServiceUnavailable
		} else if pool != nil {
			ctx, cancel := context.WithTimeout(r.Context(), HealthTimeout)
			defer cancel()
			if err := pool.Ping(ctx); err != nil {
				s.log.Warn("system: health: database ping failed", "service", name, "err", err)
				h.State, code = "the database does not answer", http.StatusServiceUnavailable
			}
		}
		svc.WriteJSON(w, code, h)
	})
}

// httpServer returns the server of h listening on listen (configured as
// addr): its Host check and its timeouts.
func (s *System) httpServer(addr string, listen net.Addr, h http.Handler) *http.Server {
	allowed := s.cfg.AllowedHosts
	if host, _, err := net.SplitHostPort(addr); err == nil && host != "" && net.ParseIP(host) == nil {
		allowed = append(slices.Clip(allowed), host) // the configured name, e.g. comandes.intern:8080
	}
	return &http.Server{Handler: hostguard.Wrap(h, listen, allowed), ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout: 30 * time.Second, WriteTimeout: HTTPWriteTimeoutDefault, IdleTimeout: 2 * time.Minute}
}

func (s *System) startService(ctx context.Context, name string) error {
	switch name {
	case comandes.Name:
		return s.startComandes(ctx)
	case inventari.Name:
		return s.startInventari(ctx)
	case pagaments.Name:
		return s.startPagaments(ctx)
	case repartiment.Name:
		return s.startRepartiment(ctx)
	case analitica.Name:
		return s.startAnalitica(ctx)
	case cataleg.Name:
		return s.startCataleg(ctx)
	}
	return fmt.Errorf("unknown service %q", name)
}

// Addrs returns the base URLs of the HTTP APIs by service name, plus
// "passarella" and "mapes" when this process runs them.
func (s *System) Addrs() map[string]string {
	return maps.Clone(s.addrs)
}

// ConsumerGroups returns the consumer group of every consumidor of
// ConsumerNames, as Config.Groups renames them (the system's groups,
// whether or not this process runs their service).
func (s *System) ConsumerGroups() []string {
	out := make([]string, 0, len(ConsumerNames))
	for _, n := range ConsumerNames {
		out = append(out, cmp.Or(s.cfg.Groups[n], n))
	}
	return out
}

// KafkaOpts returns Config.KafkaOpts: the options (a secured cluster's)
// of the system's Kafka clients, for other clients of the same brokers.
func (s *System) KafkaOpts() []kgo.Opt { return s.cfg.KafkaOpts }

// OutboxMode is where the services write their events (Config.OutboxMode).
func (s *System) OutboxMode() outbox.Mode { return s.cfg.OutboxMode }

// Pool returns the pool of service's database, or nil.
func (s *System) Pool(service string) *pgxpool.Pool { return s.pools[service] }

// DatabaseNames returns the database of each started service.
func (s *System) DatabaseNames() map[string]string {
	return maps.Clone(s.dbNames)
}

// Close stops everything Start started and waits for it: at most
// ShutdownGraceDefault for the HTTP servers to drain, and as long again for
// the relays, consumers and servers to return; one that does not is logged by
// name and left behind, so that Close always returns.
func (s *System) Close() {
	s.cancel()
	shut, cancel := context.WithTimeout(context.Background(), ShutdownGraceDefault)
	defer cancel()
	leftBehind := false
	for _, srv := range s.servers {
		if srv.Shutdown(shut) != nil {
			leftBehind = true // a handler still running
		}
	}
	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(ShutdownGraceDefault):
		leftBehind = true
		s.log.Error("system: workers did not stop in time; leaving them behind", "workers", s.sup.stillRunning())
	}
	if s.rr != nil {
		s.rr.close()
	}
	if s.kcl != nil {
		s.kcl.Close()
	}
	if s.amqpPub != nil {
		_ = s.amqpPub.Close()
	}
	if s.events != nil {
		_ = s.events.Close()
	}
	// pgxpool.Close waits for every acquired connection: with a worker or
	// handler left behind holding one, it would never return. Then the pools
	// close in the background, as that work ends.
	closePools := func() {
		for _, p := range s.pools {
			p.Close()
		}
	}
	if leftBehind {
		go closePools()
	} else {
		closePools()
	}
}
