package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/console"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/services/svc"
	"github.com/km0/km0/services/system"
)

// systemConsole starts the operator console of a running system (km0 up
// --console, km0 demo --keep-running): its dead letters indexed in the
// database km0_dlq[_suffix] on adminURL's server (created if absent, dropped
// at stop when drop is set), the lag of its outboxes and of every consumer
// group, and the health of its HTTP servers. It prints the console's URL.
// Lag alerts need km0 console or km0 lag --serve, whose flags set the
// thresholds.
func systemConsole(ctx context.Context, sys *system.System, addr, adminURL, suffix string, brokers []string, drop bool, out io.Writer, name string, log *slog.Logger) (stop func(), err error) {
	if adminURL == "" {
		return nil, errors.New("--console needs --database-url (or $KM0_DATABASE_URL): the dead-letter index gets its own database km0_dlq on that server")
	}
	dbName := svc.DatabaseName("dlq", suffix)
	u, err := svc.EnsureDatabase(ctx, adminURL, dbName)
	if err != nil {
		return nil, err
	}
	pool, err := svc.OpenPool(ctx, u, 4)
	if err != nil {
		return nil, err
	}
	var closers []func()
	cleanup := func() {
		for _, c := range slices.Backward(closers) {
			c()
		}
	}
	closers = append(closers, pool.Close)
	if drop {
		closers = append([]func(){func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = svc.DropDatabase(dctx, adminURL, dbName)
		}}, closers...)
	}
	fail := func(err error) (func(), error) { cleanup(); return nil, err }
	if _, err := migrate.Up(ctx, pool, migrate.Names{}, dlq.Migrations); err != nil {
		return fail(err)
	}
	reg := prometheus.NewRegistry()
	al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: reg, Logger: log, WebhookURL: os.Getenv("KM0_DLQ_WEBHOOK")})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer cancel()
		_ = al.Close(cctx)
	})
	kcfg := dlq.KafkaConfig{Brokers: brokers, Logger: log}
	backend, err := dlq.NewKafkaBackend(kcfg)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, backend.Close)
	store := dlq.NewStore(pool, "")
	src, err := dlq.NewService(dlq.ServiceConfig{Store: store, Backend: backend, Alerter: al, Logger: log})
	if err != nil {
		return fail(err)
	}
	ix, err := dlq.NewIndexer(dlq.IndexerConfig{Kafka: kcfg, Store: store, Alerter: al})
	if err != nil {
		return fail(err)
	}
	ictx, cancelIx := context.WithCancel(ctx)
	ixDone := make(chan struct{})
	go func() {
		defer close(ixDone)
		if err := ix.Run(ictx); err != nil && ictx.Err() == nil {
			log.Error(name+": dead-letter indexer stopped", "err", err)
		}
	}()
	closers = append(closers, func() { cancelIx(); <-ixDone })
	var outboxes []lag.Outbox
	for _, s := range slices.Sorted(maps.Keys(system.Topics)) {
		if p := sys.Pool(s); p != nil {
			outboxes = append(outboxes, lag.Outbox{Name: s, DB: p})
		}
	}
	addrs := sys.Addrs()
	var services []console.Service
	for _, k := range slices.Sorted(maps.Keys(addrs)) {
		services = append(services, console.Service{Name: k, URL: addrs[k]})
	}
	_, stopConsole, err := serveConsole(ctx, consoleParts{addr: addr, allowed: strings.Split(os.Getenv(svc.AllowedHostsEnv), ","),
		token: os.Getenv(adminTokenEnv), source: src, broker: "Kafka", alerter: al,
		lag:      lag.Config{Outboxes: outboxes, Brokers: brokers, Logger: log},
		interval: lag.IntervalDefault, services: services, reg: reg, out: out, name: name, log: log})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, stopConsole)
	return cleanup, nil
}
