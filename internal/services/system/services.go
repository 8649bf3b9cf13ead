package system

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/schema"
	"github.com/km0/km0/transport/kafka"
)

// decoder returns the consumer Decode of a handler written against handles
// (tipus → versio): it validates against the published schemas and upcasts
// comanda.creada v1 to v2 (a v1 order is a v2 order without address).
func (s *System) decoder(handles map[string]int) (func([]byte) (*envelope.Envelope, error), error) {
	up := map[schema.Key]schema.Upcaster{}
	if handles[comandes.TypeCreated] == 2 {
		up[schema.Key{Type: comandes.TypeCreated, Version: 1}] = schema.Bump
	}
	d, err := schema.NewDecoder(schema.DecoderConfig{Registry: s.schemas, Handles: handles, Upcasters: up})
	if err != nil {
		return nil, err
	}
	return d.Decode, nil
}

// outbox returns the service's outbox writer, validating every event
// against the published schemas before it is written.
func (s *System) outbox() *outbox.Outbox {
	return outbox.New(outbox.Config{Validate: s.schemas.Validate, Mode: s.cfg.OutboxMode})
}

// relayFor supervises the outbox relay of a publishing service: the polling
// relay, or with Config.RelayMode RelayCDC the CDC relay, whose server is
// checked first (wal_level, REPLICATION) so that Start fails with the fix
// instead of a relay restarting for ever.
func (s *System) relayFor(ctx context.Context, service string) error {
	cfg := relay.Config{
		Pool:         s.pools[service],
		Publisher:    s.eventsPublisher(Topics[service]),
		Topic:        s.topic(Topics[service]),
		Origin:       service,
		Workers:      1,
		PollInterval: 500 * time.Millisecond,
		Logger:       s.log.With("service", service),
		// Off (0) unless the operator asked: published rows are the replay
		// window.
		PruneOlderThan:  s.cfg.RelayPruneOlderThan,
		DeletePublished: s.cfg.RelayDeletePublished,
	}
	if s.cfg.RelayMode != RelayCDC {
		s.sup.runRelay(service, s.cfg.RelayFaults[service], cfg)
		return nil
	}
	if err := cdc.CheckServer(ctx, cfg.Pool, cfg.Names, cfg.Logger); err != nil {
		return err // Start names the service
	}
	cfg.Workers = 0
	if s.cfg.OutboxMode == outbox.ModeWAL { // its slot: migrate.WALSlot of the database, made by open
		s.sup.runCDCRelay(service, cdc.Config{Config: cfg, WAL: true})
		return nil
	}
	s.sup.runCDCRelay(service, cdc.Config{Config: cfg, Slot: cdcSlot(cfg.Pool.Config().ConnConfig.Database)})
	return nil
}

// cdcSlot is the replication slot of a service's outbox: slots are
// per server, so it is named after the service's database
// (km0_comandes_outbox), not after the table alone.
func cdcSlot(database string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(database + "_outbox") {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '_' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	slot := b.String()
	if !cdc.ValidSlot(slot) {
		return cdc.DefaultSlot(migrate.Names{Schema: database})
	}
	return slot
}

// consumerFor supervises the consumer cfg.Name of service on topics
// (contract names; Subscriptions), whose group is its consumidor
// (Config.Groups renames it): over Kafka, over RabbitMQ, or one over each
// when its topics are on both. Only the source differs; the rest of cfg is
// the same on both brokers.
func (s *System) consumerFor(service string, topics []string, cfg consumer.Config) {
	group := cmp.Or(s.cfg.Groups[cfg.Name], cfg.Name)
	cfg.Pool = s.pools[service]
	cfg.Backoff = s.cfg.Backoff
	cfg.MaxAttempts = cmp.Or(s.cfg.MaxAttempts, MaxAttemptsDefault)
	cfg.Concurrency = 2
	// In-flight work is abandoned (rolled back, redelivered later) well
	// within Close's wait for the workers; consumer.ShutdownTimeoutDefault
	// (30 s) would outlast it and the consumer would be left behind.
	cfg.ShutdownTimeout = ShutdownGraceDefault / 2
	cfg.Logger = s.log.With("service", service, "consumidor", cfg.Name)
	cfg.Pause = s.pauseFor(service, group)
	probes := s.cfg.ConsumerFaults[cfg.Name]
	worker := "consumer " + group
	var onKafka []string
	for _, t := range topics {
		if s.cfg.eventsBroker(t) == EventsKafka {
			onKafka = append(onKafka, s.topic(t))
		}
	}
	if rabbit := s.rabbitTopics(topics); len(rabbit) > 0 {
		w := worker
		if len(onKafka) > 0 {
			w += " (RabbitMQ)"
		}
		rcfg := cfg
		rcfg.OnDeadLetter = s.reasons.observer(cfg.Name)
		s.sup.runAMQPConsumer(w, group, s.amqpSource(cfg, rabbit), probes, rcfg)
	}
	if len(onKafka) > 0 {
		s.sup.runConsumer(kafka.SourceConfig{Brokers: s.cfg.Brokers, Group: group, Topics: onKafka, KgoOpts: s.cfg.KafkaOpts, TopicSettings: s.cfg.TopicSettings}, probes, cfg)
	}
}

func (s *System) startComandes(ctx context.Context) error {
	pool, err := s.open(ctx, comandes.Name, s.cfg.MaxConns+3, migrate.Outbox, migrate.Inbox, comandes.Migrations)
	if err != nil {
		return err
	}
	// Operator access to every order (GET /comandes/{id}, its cancellation)
	// only with a token in the environment; without one, each order opens
	// with its own capability only.
	cfg := comandes.Config{Pool: pool, Outbox: s.outbox(), Logger: s.log.With("service", comandes.Name), OperatorToken: os.Getenv(comandes.OperatorTokenEnv)}
	if cfg.OperatorToken == "" {
		s.log.Info("system: comandes operator access off: each order is read and cancelled with its own capacitat; set " + comandes.OperatorTokenEnv + " to allow an operator")
	}
	if s.cfg.Authorize {
		if cfg.Authorizer, err = s.rr.authorizer(ctx); err != nil {
			return err
		}
	}
	if s.Comandes, err = comandes.New(cfg); err != nil {
		return err
	}
	dec, err := s.decoder(map[string]int{comandes.TypePaymentConfirmed: 1})
	if err != nil {
		return err
	}
	if err := s.relayFor(ctx, comandes.Name); err != nil {
		return err
	}
	s.housekeep(comandes.Name, s.inboxPurger(comandes.Name), purger{what: "peticions_idempotents",
		purge: func(ctx context.Context) (int64, error) {
			return s.Comandes.PurgeRequests(ctx, s.cfg.RequestKeyRetention)
		}})
	s.consumerFor(comandes.Name, Subscriptions[comandes.ConsumerPaymentConfirmed], consumer.Config{Name: comandes.ConsumerPaymentConfirmed, Decode: dec,
		Types: []string{comandes.TypePaymentConfirmed}, Handle: s.Comandes.HandlePaymentConfirmed})
	// The compensation of an order inventari refused: cancel it.
	decRefused, err := s.decoder(map[string]int{comandes.TypeStockRefused: 1})
	if err != nil {
		return err
	}
	s.consumerFor(comandes.Name, Subscriptions[comandes.ConsumerStockRefused], consumer.Config{Name: comandes.ConsumerStockRefused, Decode: decRefused,
		Types: []string{comandes.TypeStockRefused}, Handle: s.Comandes.HandleStockRefused})
	// repartiment's side: the copy of its coverage (POST /comandes refuses an
	// uncovered city) and the compensation of an order it rejected.
	decDelivery, err := s.decoder(map[string]int{comandes.TypeCoverage: 1, comandes.TypeDeliveryRejected: 1})
	if err != nil {
		return err
	}
	s.consumerFor(comandes.Name, Subscriptions[comandes.ConsumerDelivery], consumer.Config{Name: comandes.ConsumerDelivery, Decode: decDelivery,
		Types: []string{comandes.TypeCoverage, comandes.TypeDeliveryRejected}, Handle: s.Comandes.HandleDelivery})
	return s.serve(comandes.Name, s.Comandes.Handler())
}

func (s *System) startInventari(ctx context.Context) error {
	pool, err := s.open(ctx, inventari.Name, s.cfg.MaxConns, migrate.Outbox, migrate.Inbox, keyorder.Migrations, inventari.Migrations)
	if err != nil {
		return err
	}
	if s.Inventari, err = inventari.New(inventari.Config{Pool: pool, Outbox: s.outbox(), Logger: s.log.With("service", inventari.Name)}); err != nil {
		return err
	}
	dec, err := s.decoder(map[string]int{comandes.TypeCreated: 2, comandes.TypeCancelled: 1})
	if err != nil {
		return err
	}
	if err := s.relayFor(ctx, inventari.Name); err != nil {
		return err
	}
	s.housekeep(inventari.Name, s.inboxPurger(inventari.Name))
	s.consumerFor(inventari.Name, Subscriptions[inventari.ConsumerDecrement], consumer.Config{Name: inventari.ConsumerDecrement, Decode: dec, Order: consumer.PerKey, FinalFailure: inventari.Final,
		Types: []string{inventari.TypeOrderCreated, inventari.TypeOrderCancelled}, HandleBatchOutcomes: s.Inventari.HandleOrdersCreated, BatchSize: inventari.ConsumerBatchSize})
	if err := s.rr.serve(ctx, inventari.ReserveQueue, rrWorkersDefault, s.Inventari.Reserve); err != nil {
		return err
	}
	return s.serve(inventari.Name, s.Inventari.Handler())
}

func (s *System) startPagaments(ctx context.Context) error {
	pool, err := s.open(ctx, pagaments.Name, s.cfg.MaxConns, migrate.Outbox, migrate.Inbox, keyorder.Migrations, pagaments.Migrations)
	if err != nil {
		return err
	}
	gatewayURL, gatewayKey := s.cfg.GatewayURL, s.cfg.GatewayAPIKey
	if gatewayURL == "" {
		// The simulated gateway keeps its own storage: schema passarella of
		// km0_pagaments, through a pool of its own.
		gwPool, err := svc.OpenPool(ctx, pool.Config().ConnString(), 2)
		if err != nil {
			return err
		}
		s.pools[GatewayName] = gwPool
		if _, err := migrate.Up(ctx, gwPool, migrate.Names{Schema: passarella.SchemaDefault}, passarella.Migrations); err != nil {
			return fmt.Errorf("migrate passarella: %w", err)
		}
		if s.Gateway, err = passarella.New(passarella.Config{Pool: gwPool, APIKey: gatewayKey, Faults: s.cfg.GatewayFaults, Logger: s.log.With("service", GatewayName)}); err != nil {
			return err
		}
		if err := s.serve(GatewayName, s.Gateway.Handler()); err != nil {
			return err
		}
		gatewayURL, gatewayKey = s.addrs[GatewayName], s.Gateway.APIKey()
	}
	s.Pagaments, err = pagaments.New(pagaments.Config{Pool: pool, Outbox: s.outbox(), Logger: s.log.With("service", pagaments.Name), RequireApproval: s.cfg.Authorize,
		Gateway: &passarella.Client{BaseURL: gatewayURL, APIKey: gatewayKey, Timeout: s.cfg.GatewayTimeout}})
	if err != nil {
		return err
	}
	dec, err := s.decoder(map[string]int{comandes.TypeCreated: 2, comandes.TypeCancelled: 1})
	if err != nil {
		return err
	}
	if err := s.relayFor(ctx, pagaments.Name); err != nil {
		return err
	}
	// pagaments has no HTTP API of its own (it answers by request/reply):
	// a server of its health alone, so that health shows every service.
	if err := s.serve(pagaments.Name, http.NotFoundHandler()); err != nil {
		return err
	}
	s.housekeep(pagaments.Name, s.inboxPurger(pagaments.Name))
	// One order per transaction: each attempt calls the gateway, and a failed
	// neighbour must not make a whole batch call it again. The charge and
	// the refund share the consumer (per-key order keeps them in order).
	s.consumerFor(pagaments.Name, Subscriptions[pagaments.ConsumerCharge], consumer.Config{Name: pagaments.ConsumerCharge, BatchSize: 1, Decode: dec, Order: consumer.PerKey, FinalFailure: pagaments.Final,
		Types: []string{pagaments.TypeOrderCreated, pagaments.TypeOrderCancelled}, Handle: s.Pagaments.HandleOrder})
	return s.rr.serve(ctx, pagaments.AuthQueue, rrWorkersAuthorize, s.Pagaments.Authorize)
}

func (s *System) startRepartiment(ctx context.Context) error {
	pool, err := s.open(ctx, repartiment.Name, s.cfg.MaxConns, migrate.Outbox, migrate.Inbox, keyorder.Migrations, repartiment.Migrations)
	if err != nil {
		return err
	}
	side, err := svc.OpenPool(ctx, pool.Config().ConnString(), 2)
	if err != nil {
		return err
	}
	s.pools[repartiment.Name+"-side"] = side
	s.Maps = &repartiment.MapsServer{Fail: s.cfg.MapsFail}
	if err := s.serve(MapsName, s.Maps.Handler()); err != nil {
		return err
	}
	s.Repartiment, err = repartiment.New(repartiment.Config{Pool: pool, SidePool: side, Outbox: s.outbox(), DeliveryTime: s.cfg.DeliveryTime,
		Maps: &repartiment.MapsClient{BaseURL: s.addrs[MapsName]}, Logger: s.log.With("service", repartiment.Name)})
	if err != nil {
		return err
	}
	// The address check stays in the handler (not a Require of the decoder):
	// it raises the contract alert before dead-lettering.
	dec, err := s.decoder(map[string]int{repartiment.TypeOrderPaid: 1, repartiment.TypeOrderCancelled: 1})
	if err != nil {
		return err
	}
	if err := s.relayFor(ctx, repartiment.Name); err != nil {
		return err
	}
	s.housekeep(repartiment.Name, s.inboxPurger(repartiment.Name))
	// A snapshot of the coverage at every start: a comandes whose copy was
	// lost (a new database) gets one.
	if _, err := s.Repartiment.PublishCoverage(ctx); err != nil {
		return err
	}
	// An uncovered city is final (repartiment.Final): dead-lettered with its
	// repartiment.rebutjat, it does not block the order's key, so the
	// order's comanda.cancellada (its compensation) is applied behind it.
	s.consumerFor(repartiment.Name, Subscriptions[repartiment.ConsumerAssign], consumer.Config{Name: repartiment.ConsumerAssign, Decode: dec, Order: consumer.PerKey, FinalFailure: repartiment.Final,
		Types: []string{repartiment.TypeOrderPaid, repartiment.TypeOrderCancelled}, Handle: s.Repartiment.HandleOrder, Classifier: repartiment.Classifier})
	s.wg.Go(func() { _ = s.Repartiment.RunAssigner(s.ctx, s.cfg.AssignInterval) })
	return s.serve(repartiment.Name, s.Repartiment.Handler())
}

func (s *System) startAnalitica(ctx context.Context) error {
	pool, err := s.open(ctx, analitica.Name, 3, analitica.Migrations)
	if err != nil {
		return err
	}
	if s.Analitica, err = analitica.New(pool); err != nil {
		return err
	}
	// At-most-once: offsets committed before processing, no inbox.
	s.consumerFor(analitica.Name, Subscriptions[analitica.ConsumerCount], consumer.Config{Name: analitica.ConsumerCount, Mode: consumer.AtMostOnce, NoInbox: true,
		Handle: s.Analitica.HandleEvent})
	return s.serve(analitica.Name, s.Analitica.Handler())
}

func (s *System) startCataleg(ctx context.Context) error {
	pool, err := s.open(ctx, cataleg.Name, 3, cataleg.Migrations)
	if err != nil {
		return err
	}
	if s.Cataleg, err = cataleg.New(pool); err != nil {
		return err
	}
	// Idempotent by nature: no inbox table, no key.
	dec, err := s.decoder(map[string]int{cataleg.TypeStockUpdated: 1})
	if err != nil {
		return err
	}
	s.consumerFor(cataleg.Name, Subscriptions[cataleg.ConsumerLowStock], consumer.Config{Name: cataleg.ConsumerLowStock, NoInbox: true, Decode: dec,
		Types: []string{cataleg.TypeStockUpdated}, Handle: s.Cataleg.HandleStockUpdated})
	return s.serve(cataleg.Name, s.Cataleg.Handler())
}
