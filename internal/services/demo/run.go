package demo

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// Defaults of Config.
const (
	OrdersDefault        = 1000
	ClientsDefault       = 8
	SettleTimeoutDefault = 3 * time.Minute
)

// Config configures Run.
type Config struct {
	Orders  int // default OrdersDefault
	Clients int // concurrent HTTP clients; default ClientsDefault
	// DatabaseURL, if set, is used as is; otherwise FindServer decides
	// (KM0_DATABASE_URL, the local server, a throwaway cluster).
	DatabaseURL string
	// AMQPURL, if set, carries request/reply over RabbitMQ; else over the
	// embedded Kafka. With events on RabbitMQ it defaults to the local guest
	// broker (amqp.URLDefault).
	AMQPURL string
	// Events and EventsByTopic choose the broker of the domain events
	// (system.Config's fields of the same names). Default Kafka (embedded).
	// Over RabbitMQ the run uses an exchange and queues of its own, deleted
	// at the end, and no Kafka at all unless a topic stays there.
	Events        string
	EventsByTopic map[string]string
	// KafkaDown, if positive, makes the embedded Kafka unreachable for this
	// long once a third of the orders are in: with the orders on RabbitMQ
	// (EventsByTopic) inventari keeps taking stock and its estoc.actualitzat
	// wait in its outbox; with them on Kafka it stops. The report says which
	// and checks that nothing was lost. Needs Kafka in the run.
	KafkaDown time.Duration
	// NoAuthorize turns off the card authorisation that comandes asks
	// pagaments for by request/reply before accepting each order.
	NoAuthorize bool
	// KeepRunning leaves the services up after the report until ctx ends.
	KeepRunning bool
	// KeepDatabases keeps the run's databases (default: dropped at the end).
	KeepDatabases bool
	// SettleTimeout bounds the wait for outboxes and consumer lag to drain.
	SettleTimeout time.Duration
	Seed          uint64 // scenario seed; default 1
	// OnReport, if set, receives the report before the services stop (and
	// before KeepRunning waits).
	OnReport func(*Report)
	// OnRunning, with KeepRunning, is called once the report is out and
	// before the wait, with the running system (km0 demo --keep-running
	// starts the operator console there); stop is called when the demo ends.
	OnRunning func(ctx context.Context, r Running) (stop func(), err error)
	Out       io.Writer    // progress and addresses; default io.Discard
	Logger    *slog.Logger // default: discard
}

// Running is what Config.OnRunning gets: the system left running, its
// brokers, and the PostgreSQL server (an admin URL) and database suffix of
// the run.
type Running struct {
	System         *system.System
	Brokers        []string
	DatabaseURL    string
	DatabaseSuffix string
}

// Run runs the whole demo and returns its report. The error is for a demo
// that could not run (no database, a service that did not start); a run whose
// invariants fail returns a report with OK false and no error.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.Orders = cmp.Or(cfg.Orders, OrdersDefault)
	cfg.Clients = cmp.Or(cfg.Clients, ClientsDefault)
	cfg.SettleTimeout = cmp.Or(cfg.SettleTimeout, SettleTimeoutDefault)
	cfg.Seed = cmp.Or(cfg.Seed, 1)
	if !system.RequestReplyAvailable {
		cfg.NoAuthorize = true
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.Orders < 1 || cfg.Clients < 1 {
		return nil, fmt.Errorf("demo: --orders and clients must be positive (got %d, %d)", cfg.Orders, cfg.Clients)
	}
	start := time.Now()
	var sayMu sync.Mutex // progress comes from the clients and the Kafka outage at once
	say := func(format string, args ...any) {
		sayMu.Lock()
		defer sayMu.Unlock()
		fmt.Fprintf(cfg.Out, "[%5.1fs] %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, args...))
	}

	var server *Server
	if cfg.DatabaseURL != "" {
		server = &Server{URL: cfg.DatabaseURL, Source: "--database-url"}
	} else {
		var err error
		if server, err = FindServer(ctx, func(s string) { say("%s", s) }); err != nil {
			return nil, err
		}
	}
	defer server.Close()
	say("PostgreSQL: %s (%s)", server.Source, redact.URL(server.URL))

	run := randomSuffix()
	plan := makePlan(cfg.Orders, cfg.Seed, run, !cfg.NoAuthorize)
	markWithdrawn(plan)
	inject := newInjector(cfg.Orders)
	sysCfg := system.Config{
		DatabaseURL: server.URL, DatabaseSuffix: "demo_" + run, AMQPURL: cfg.AMQPURL, Authorize: !cfg.NoAuthorize,
		Events: cfg.Events, EventsByTopic: cfg.EventsByTopic,
		GatewayFaults: passarella.Faults{
			// Charges only: a refund is asked while its order's charge may
			// be waiting for the retry these faults cause.
			Fail: func(key string, attempt int) bool {
				return strings.HasPrefix(key, "cobrament-") && gatewayFails(orderNum(key), attempt)
			},
			Hang: func(key string, attempt int) bool {
				return strings.HasPrefix(key, "cobrament-") && gatewayHangs(orderNum(key), attempt)
			},
			HangFor: 1500 * time.Millisecond,
		},
		GatewayTimeout: 500 * time.Millisecond,
		MapsFail:       func(id string, attempt int) bool { return mapsFails(orderNum(id), attempt) },
		DeliveryTime:   150 * time.Millisecond,
		AssignInterval: 100 * time.Millisecond,
		Backoff:        200 * time.Millisecond,
		RelayFaults:    map[string]faults.Relay{comandes.Name: {AfterPublish: inject.relayAfterPublish}},
		ConsumerFaults: map[string]faults.Consumer[*consumer.Message]{inventari.ConsumerDecrement: {AfterCommit: inject.consumerAfterCommit}},
		PaymentFaults:  faults.Payments{AfterCharge: inject.afterCharge},
		Logger:         cfg.Logger,
	}
	if sysCfg.NeedsRabbitMQ() && sysCfg.AMQPURL == "" {
		sysCfg.AMQPURL = amqp.URLDefault
	}
	if sysCfg.SigningKey = requestreply.SigningKeyFromEnv(); sysCfg.SigningKey == nil {
		sysCfg.SigningKey = runKey() // signed by default: comandes and pagaments share this process
	}
	var broker *kafkaembed.Broker
	if sysCfg.NeedsKafka() {
		var err error
		if broker, err = kafkaembed.Start(kafkaembed.Config{Topics: system.DomainTopics()}); err != nil {
			return nil, err
		}
		defer broker.Close()
		sysCfg.Brokers = broker.Addrs()
		say("Kafka: embedded broker (kfake) at %s", strings.Join(broker.Addrs(), ", "))
	}
	if cfg.KafkaDown > 0 && broker == nil {
		return nil, errors.New("demo: --kafka-down needs Kafka in the run: keep some topic on it, e.g. --events kafka,comandes.esdeveniments=rabbitmq")
	}
	var rmq *rabbit
	if sysCfg.NeedsRabbitMQ() {
		var topics []string
		for _, t := range system.Topics {
			if b := cmp.Or(cfg.EventsByTopic[t], cfg.Events); b == system.EventsRabbitMQ {
				topics = append(topics, t)
			}
		}
		var err error
		if rmq, err = newRabbit(ctx, sysCfg.AMQPURL, run, topics, cfg.Logger); err != nil {
			return nil, err
		}
		rmq.configure(&sysCfg)
		say("RabbitMQ: %s, exchange %s, queues %s* (deleted at the end)", redact.URL(sysCfg.AMQPURL), rmq.exchange, rmq.prefix)
	}
	sys, err := system.Start(ctx, sysCfg)
	if err != nil {
		if rmq != nil {
			_ = rmq.close(context.WithoutCancel(ctx), nil)
		}
		return nil, err
	}
	stopped := false
	cleanup := func() {
		if stopped {
			return
		}
		stopped = true
		sys.Close()
		if rmq != nil {
			delCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			if err := rmq.close(delCtx, sys); err != nil {
				cfg.Logger.Warn("demo: delete RabbitMQ queues", "err", err)
			}
		}
		if !cfg.KeepDatabases {
			dropCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			for _, name := range sys.DatabaseNames() {
				if err := svc.DropDatabase(dropCtx, server.URL, name); err != nil {
					cfg.Logger.Warn("demo: drop database", "name", name, "err", err)
				}
			}
		}
	}
	defer cleanup()
	say("services running: %s (databases km0_<service>_demo_%s)", strings.Join(system.Services, ", "), run)

	restock := restockFor(plan)
	for prod, n := range restock {
		if err := sys.Inventari.Restock(ctx, prod, n); err != nil {
			return nil, err
		}
	}
	say("restocked %d products so that only the aged cheese (5 units) runs out", len(restock))

	// WithdrawnCity joins the coverage now and leaves it after the drive;
	// comandes must hold the new snapshot before the first order (else it
	// accepts Perpinyà, which repartiment would reject and the saga refund).
	if _, err := sys.Repartiment.SetCovered(ctx, WithdrawnCity, true); err != nil {
		return nil, err
	}
	if err := waitCoverage(ctx, sys.Pool(comandes.Name), WithdrawnCity, true); err != nil {
		return nil, err
	}
	say("coverage: comandes holds repartiment's snapshot (%s added, without couriers; %s not covered)", WithdrawnCity, UncoveredCity)

	d := &driver{url: sys.Addrs()[comandes.Name], client: &http.Client{Timeout: 30 * time.Second}}
	step := max(cfg.Orders/10, 1)
	var out *outage
	if cfg.KafkaDown > 0 {
		out = newOutage(cfg.KafkaDown, broker, sys, say)
	}
	d.onOrder = func(done int) {
		if done%step == 0 || done == cfg.Orders {
			say("orders sent %d/%d", done, cfg.Orders)
		}
		if out != nil && done >= max(cfg.Orders/3, 1) {
			out.start(ctx)
		}
	}
	say("sending %d orders from %d concurrent clients (duplicates, too much cheese: cancelled and refunded, client cancellations, an uncovered city, versio 1 clients, a gateway that fails and hangs, a relay and a consumer that crash)", cfg.Orders, cfg.Clients)
	sub := d.run(ctx, plan, cfg.Clients)
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if out != nil {
		out.wait(ctx)
	}
	say("orders sent: %d accepted, %d duplicates absorbed; waiting for the system to settle", sub.Accepted, sub.Replayed)
	rejected, err := sys.Repartiment.SetCovered(ctx, WithdrawnCity, false)
	if err != nil {
		return nil, err
	}
	say("coverage: %s withdrawn; %d pending deliveries rejected (the orders paid later are rejected on arrival), to be cancelled and refunded", WithdrawnCity, rejected)

	ev := &eventLog{sys: sys, rabbit: rmq}
	if broker != nil {
		ev.brokers = broker.Addrs()
		if ev.kcl, err = kgo.NewClient(kgo.SeedBrokers(broker.Addrs()...)); err != nil {
			return nil, err
		}
		defer ev.kcl.Close()
	}
	report := &Report{Run: run, Database: server.Source, RequestReply: sys.RequestReplyTransport(), EventsBroker: ev.describe()}
	if cfg.NoAuthorize {
		report.RequestReply += " (authorisation off)"
	}
	settled, why := settle(ctx, sys, ev, cfg.SettleTimeout, say)
	if settled {
		// Orders paid and assigned a courier, cancelled now: the courier is
		// released and the charge refunded.
		n := d.cancelLate(ctx, plan)
		say("%d orders already paid and assigned, cancelled; waiting for the system to settle", n)
		sub = d.result()
		settled, why = settle(ctx, sys, ev, cfg.SettleTimeout, say)
	}
	report.check("system settled: outboxes empty, consumer lag 0, no delivery pending", settled, "%s", why)
	report.Injected = inject.fired() // after settling: the charge may fire late
	if err := reconcile(ctx, sys, ev, plan, sub, restock, report); err != nil {
		return nil, fmt.Errorf("demo: reconcile: %w", err)
	}
	if out != nil {
		out.check(report)
	}
	report.Elapsed = time.Since(start).Seconds()
	report.OK = len(report.Failed()) == 0
	report.Verdict = verdict(report.Invariants)
	if cfg.OnReport != nil {
		cfg.OnReport(report)
	}
	if cfg.KeepRunning && ctx.Err() == nil {
		addrs := sys.Addrs()
		fmt.Fprintf(cfg.Out, "\nThe services keep running (Ctrl-C stops them):\n")
		for _, k := range sortedKeys(addrs) {
			fmt.Fprintf(cfg.Out, "  %-12s %s\n", k, addrs[k])
		}
		var brokers []string
		if broker != nil {
			brokers = broker.Addrs()
			fmt.Fprintf(cfg.Out, "  %-12s %s\n", "kafka", strings.Join(brokers, ", "))
		}
		fmt.Fprintf(cfg.Out, "  try: curl %s/comandes/P-2026-000001 · curl %s/analitica · curl %s/cataleg\n",
			addrs[comandes.Name], addrs["analitica"], addrs["cataleg"])
		if cfg.OnRunning != nil {
			stop, err := cfg.OnRunning(ctx, Running{System: sys, Brokers: brokers, DatabaseURL: server.URL, DatabaseSuffix: sysCfg.DatabaseSuffix})
			if err != nil {
				return report, err
			}
			defer stop()
		}
		<-ctx.Done()
	}
	return report, nil
}

// settle waits until every outbox is drained, every consumer has caught up
// and no delivery is pending, three polls in a row. Over RabbitMQ, caught
// up means no message ready in any work, shard or wait queue and the
// consumers' counts unchanged: RabbitMQ tells a client how many messages
// are ready, not how many its consumers hold unacked, so the counts must
// also stand still over several polls (a message in a consumer's hands
// moves them within a handler's time, well under the 2 s window).
func settle(ctx context.Context, sys *system.System, ev *eventLog, timeout time.Duration, say func(string, ...any)) (bool, string) {
	deadline := time.Now().Add(timeout)
	var groups []string
	for _, g := range []string{comandes.ConsumerPaymentConfirmed, comandes.ConsumerStockRefused, comandes.ConsumerDelivery, inventari.ConsumerDecrement, pagaments.ConsumerCharge,
		repartiment.ConsumerAssign, "analitica.comptadors", "cataleg.estoc_baix"} {
		if ev.onKafka(g) {
			groups = append(groups, g)
		}
	}
	need := 3
	if ev.rabbit != nil {
		need = 7 // 2 s at 300 ms
	}
	stable, last := 0, ""
	var lastStats map[string]consumer.Stats
	lastSaid := time.Now()
	for {
		pending := 0
		for _, s := range []string{comandes.Name, inventari.Name, pagaments.Name, repartiment.Name} {
			n, err := countOf(ctx, sys.Pool(s), `SELECT count(*) FROM outbox WHERE publicat_en IS NULL`)
			if err != nil {
				return false, err.Error()
			}
			pending += n
		}
		var lag int64
		var behind []string
		if len(groups) > 0 {
			lags, err := groupLag(ctx, ev.kcl, groups)
			if err != nil {
				lag = -1
			}
			for _, g := range groups {
				l, ok := lags[g]
				if !ok {
					lag = -1
					break
				}
				lag += l
				if l > 0 {
					behind = append(behind, fmt.Sprintf("%s %d", g, l))
				}
			}
		}
		moving := false
		if ev.rabbit != nil {
			n, queues, err := ev.rabbit.backlog(ctx, sys)
			if err != nil {
				lag = -1
			} else {
				lag += int64(n)
				behind = append(behind, queues...)
			}
			st := sys.ConsumerStats()
			moving = !maps.Equal(st, lastStats)
			lastStats = st
		}
		sum, err := sys.Repartiment.Summary(ctx)
		if err != nil {
			return false, err.Error()
		}
		last = fmt.Sprintf("outbox rows pending %d, consumer lag %d (%s), deliveries pending %d", pending, lag, listOr(behind, "none behind"), sum[repartiment.StatePending])
		if pending == 0 && lag == 0 && !moving && sum[repartiment.StatePending] == 0 {
			stable++
			if stable >= need {
				return true, last
			}
		} else {
			stable = 0
		}
		if time.Since(lastSaid) > 2*time.Second {
			say("settling: %s", last)
			lastSaid = time.Now()
		}
		if time.Now().After(deadline) {
			return false, "timed out: " + last
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err().Error()
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// injector injects the crashes of the scenario, once each.
type injector struct {
	relayAt, consumerAt, chargeAt int64
	published, committed          atomic.Int64
	relayDone, consumerDone       atomic.Bool
	chargeOnce                    sync.Once
	chargeDone                    atomic.Bool
}

// fired reports which injected failures happened, for the reconciliation.
func (f *injector) fired() map[string]bool {
	return map[string]bool{injectedRelay: f.relayDone.Load(), injectedConsumer: f.consumerDone.Load(), injectedCharge: f.chargeDone.Load()}
}

func newInjector(orders int) *injector {
	return &injector{relayAt: int64(max(orders/3, 1)), consumerAt: int64(max(orders/2, 1)), chargeAt: int64(max(orders/4, 1))}
}

// relayAfterPublish kills comandes' relay once, after the broker confirmed a
// batch and before the rows are marked: the batch is published again.
func (f *injector) relayAfterPublish(rows int) error {
	if f.published.Add(int64(rows)) >= f.relayAt && f.relayDone.CompareAndSwap(false, true) {
		return faults.ErrCrashed
	}
	return nil
}

// consumerAfterCommit kills inventari's consumer once, after its transaction
// committed and before its offsets are committed: the batch is redelivered.
func (f *injector) consumerAfterCommit(_ context.Context, msgs []*consumer.Message) error {
	if f.committed.Add(int64(len(msgs))) >= f.consumerAt && f.consumerDone.CompareAndSwap(false, true) {
		return faults.ErrCrashed
	}
	return nil
}

// afterCharge makes one charging attempt die after the gateway charged and
// before the payment commits: the retry must not charge twice.
func (f *injector) afterCharge(orderID string) error {
	var err error
	if int64(orderNum(orderID)) >= f.chargeAt {
		f.chargeOnce.Do(func() {
			f.chargeDone.Store(true)
			err = errors.New("simulated crash between the gateway and COMMIT")
		})
	}
	return err
}

// runKey returns a random request/reply signing key for one run: 32 bytes,
// hex-encoded.
func runKey() []byte {
	b := make([]byte, requestreply.MinKeyBytes)
	_, _ = rand.Read(b)
	return []byte(hex.EncodeToString(b))
}

func randomSuffix() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// waitCoverage polls comandes's copy of the coverage (pool: km0_comandes)
// until it holds a snapshot in which city is covered (or not), for at most
// 30 s.
func waitCoverage(ctx context.Context, pool *pgxpool.Pool, city string, covered bool) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		var known, in bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM cobertura), EXISTS (SELECT 1 FROM ciutats_cobertes WHERE ciutat = lower($1))`, city).Scan(&known, &in)
		if err == nil && known && in == covered {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo: comandes has no coverage snapshot with %s covered=%v after 30 s (is comandes.repartiment consuming repartiment.esdeveniments?): %v", city, covered, cmp.Or(err, ctx.Err()))
		case <-time.After(50 * time.Millisecond): // polling with a deadline
		}
	}
}
