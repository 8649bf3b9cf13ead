// Package consolesrv puts the operator console together for km0 console
// and km0 up: the console's HTTP server (pages, the DLQ admin API,
// /metrics) behind the Host check, and its lag sampler over the outboxes,
// consumer groups and queues to measure.
package consolesrv

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/transport/kafka/kafkalag"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Parts is what Serve puts together: the dead-letter source,
// the lag measurer and the services.
type Parts struct {
	KeyOrder       keyorder.DBTX // the per-key order consumers' keyorder tables; nil: none shown
	KeyOrderSchema string
	ServiceDBs     []console.ServiceDB // the services' own databases: blocked keys, pause
	Addr           string
	Allowed        []string
	Token          string
	Source         dlq.Source
	Broker         string
	Alerter        *dlq.Alerter // lag alerts go through its webhook; nil: none
	Lag            LagTargets
	Rule           lag.Rule
	Interval       time.Duration
	Services       []console.Service
	Registry       *prometheus.Registry // served at /metrics with the lag collector
	// AllGroups shows the foreign groups by default, in the page, /metrics
	// and the alerts; without it they are measured but shown only on request.
	AllGroups bool
	Out       io.Writer
	Name      string        // the command, for the printed lines
	Log       *slog.Logger  // default cli.Logger()
	Retention time.Duration // default inbox.RetentionDefault
}

// Serve starts the console's HTTP server and its lag sampler; both
// stop when ctx ends (then stop returns after they did).
func Serve(ctx context.Context, p Parts) (url string, stop func(), err error) {
	if p.Log == nil {
		p.Log = cli.Logger()
	}
	if p.Lag.Logger == nil {
		p.Lag.Logger = p.Log
	}
	// Foreign groups are measured so that ?groups=all can show them; the
	// page, /metrics and the alerts leave them out unless allGroups.
	p.Lag.AllGroups = len(p.Lag.Brokers) > 0
	p.Rule.AllGroups = p.AllGroups
	m, err := p.Lag.Measurer()
	if err != nil {
		return "", nil, err
	}
	var watch *lag.Watch
	if p.Alerter != nil && p.Rule.On() {
		watch = lag.NewWatch(p.Rule, p.Alerter)
	}
	sampler := lag.NewSampler(lag.SamplerConfig{Measurer: m, Interval: p.Interval, Watch: watch, Logger: p.Log})
	if p.Registry == nil {
		p.Registry = prometheus.NewRegistry()
	}
	if err := p.Registry.Register(lag.Collector{S: sampler, AllGroups: p.AllGroups}); err != nil {
		m.Close()
		return "", nil, err
	}
	gate := dlq.NewGate(p.Token, dlq.GateConfig{}) // one attempt budget for the login and the admin API
	con, err := console.New(console.Config{Source: p.Source, Broker: p.Broker, Gate: gate, Sampler: sampler, AllGroups: p.AllGroups,
		Services: p.Services, Logger: p.Log, Retention: p.Retention, KeyOrder: p.KeyOrder, KeyOrderSchema: p.KeyOrderSchema,
		ServiceDBs: p.ServiceDBs})
	if err != nil {
		m.Close()
		return "", nil, err
	}
	ln, err := net.Listen("tcp", p.Addr)
	if err != nil {
		m.Close()
		return "", nil, fmt.Errorf("console: listen %s: %w", p.Addr, err)
	}
	mux := http.NewServeMux()
	// The console's registry, and the default one (the process's own metrics).
	mux.Handle("GET /metrics", promhttp.HandlerFor(prometheus.Gatherers{p.Registry, prometheus.DefaultGatherer}, promhttp.HandlerOpts{}))
	if p.Source != nil {
		mux.Handle("/dlq/", http.StripPrefix("/dlq", dlq.Handler(p.Source, dlq.HandlerConfig{Gate: gate, Logger: p.Log})))
	}
	mux.Handle("/", con.Handler())
	srv := console.NewServer(ln, mux, p.Allowed)
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{}, 2)
	go func() { _ = srv.Serve(ln); done <- struct{}{} }()
	go func() { _ = sampler.Run(sctx); done <- struct{}{} }()
	url = "http://" + ln.Addr().String()
	access := "log in with $" + dlqcli.AdminTokenEnv + " to read letters, replay and purge; /dlq/ needs it as a bearer token"
	if p.Token == "" {
		access = "counts only: set $" + dlqcli.AdminTokenEnv + " to read letters, replay and purge, here and at /dlq/"
	}
	fmt.Fprintf(p.Out, "%s: console at %s/ (%s; metrics at /metrics)\n", p.Name, url, access)
	return url, func() {
		cancel()
		_ = srv.Close()
		<-done
		<-done
		con.Close()
		m.Close()
	}, nil
}

// LagTargets is what km0 console and km0 lag measure: a lag.Config and
// the Kafka brokers (with their client options, known once the security
// flags are read) whose probe measurer adds.
type LagTargets struct {
	lag.Config
	Brokers    []string
	ClientOpts []kgo.Opt
}

// Measurer returns the Measurer of t, with a kafkalag probe of t.Brokers
// (closed with the Measurer).
func (t LagTargets) Measurer() (*lag.Measurer, error) {
	cfg := t.Config
	if len(t.Brokers) > 0 {
		p, err := kafkalag.New(kafkalag.Config{Brokers: t.Brokers, ClientOpts: t.ClientOpts, Logger: cfg.Logger})
		if err != nil {
			return nil, err
		}
		cfg.Kafka = p
	}
	m, err := lag.NewMeasurer(cfg)
	if err != nil && cfg.Kafka != nil {
		cfg.Kafka.Close()
	}
	return m, err
}
