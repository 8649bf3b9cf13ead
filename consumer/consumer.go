package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/transport"
)

// Consumer runs a Handler on the messages of its Source idempotently (see
// the package doc). Build it with New and start it with Run.
type Consumer struct {
	cfg        Config
	log        *slog.Logger
	m          *metrics
	counts     counters
	types      map[string]bool // nil: every tipus
	insertKeys string          // bulk key insert, see batch.go
	deleteKeys string          // keys of refused messages, see batch.go
	sem        chan struct{}
	order      *keyorder.Store // per-key order (Config.Order PerKey); nil: unordered
	isApplied  string          // is a key recorded, see order.go

	started atomic.Bool
	faults  faults.Consumer[*Message] // crash points of Run's context (tests only)

	crashOnce sync.Once
	crashErr  error
	crashCh   chan struct{}
}

// New checks cfg (after WithDefaults) and returns a Consumer. It does not
// connect: Run does. A bad config, the Source's included, returns an error
// wrapping ErrConfig.
func New(cfg Config) (*Consumer, error) {
	cfg = cfg.WithDefaults()
	err := cfg.validate()
	if cfg.Source != nil {
		if verr := cfg.Source.Validate(); verr != nil {
			err = errors.Join(err, fmt.Errorf("%w: Source: %w", ErrConfig, verr))
		}
	}
	if err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Metrics, cfg.Source.Label(), cfg.Name)
	if err != nil {
		return nil, err
	}
	c := &Consumer{
		cfg:        cfg,
		log:        cfg.Logger.With("grup", cfg.Source.Label(), "consumidor", cfg.Name),
		m:          m,
		insertKeys: bulkInsertSQL(cfg.Inbox.Table()),
		deleteKeys: bulkDeleteSQL(cfg.Inbox.Table()),
		sem:        make(chan struct{}, cfg.Concurrency),
		counts:     newCounters(),
		crashCh:    make(chan struct{}),
	}
	if cfg.Order == PerKey {
		if c.order, err = keyorder.New(keyorder.Config{Schema: cfg.Names.Schema, Behind: cfg.Behind}); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrConfig, err)
		}
		c.isApplied = "SELECT EXISTS (SELECT 1 FROM " + cfg.Inbox.Table() + " WHERE id_missatge = $1 AND consumidor = $2)"
	}
	if len(cfg.Types) > 0 {
		c.types = map[string]bool{}
		for _, t := range cfg.Types {
			c.types[t] = true
		}
	}
	return c, nil
}

// ErrAlreadyRun is returned by a second call of Run.
var ErrAlreadyRun = errors.New("consumer: Run called twice")

// Run consumes until ctx is done. Then it stops taking messages, lets
// in-flight batches finish, settles finished work (commits offsets, acks)
// and returns nil, all within ShutdownTimeout: past it in-flight work is
// abandoned (rolled back, redelivered later). It returns the Source's error
// when the broker cannot be used (a client cannot be created, the .retry/.dlq
// topics cannot be ensured, the AMQP connection is closed).
func (c *Consumer) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return ErrAlreadyRun
	}
	c.faults = faults.ConsumerFrom[*Message](ctx)
	if c.order != nil {
		if err := c.checkOrderTables(ctx); err != nil {
			return err
		}
	}
	err := c.cfg.Source.Run(ctx, pipeline{c})
	if c.Err() != nil {
		return fmt.Errorf("consumer %s: %w", c.cfg.Name, c.Err())
	}
	return err
}

// crash kills the consumer as a process death at this point would: the
// source settles nothing more, in-flight transactions roll back, Run
// returns err.
func (c *Consumer) crash(err error) {
	c.crashOnce.Do(func() {
		if !errors.Is(err, faults.ErrCrashed) {
			err = fmt.Errorf("%w: %w", faults.ErrCrashed, err)
		}
		c.crashErr = err
		c.log.Warn("consumer: crashed (fault injection)", "err", err)
		close(c.crashCh)
	})
}

// Err returns the crash error once a crash point killed the consumer.
func (c *Consumer) Err() error {
	select {
	case <-c.crashCh:
		return c.crashErr
	default:
		return nil
	}
}

// hook runs a crash point; a non-nil result crashes the consumer.
func (c *Consumer) hook(err error) error {
	if err != nil {
		c.crash(err)
		return c.crashErr
	}
	return nil
}

// pipeline is the transport.Pipeline a Consumer gives its Source. Its
// methods are not the Consumer's own, so a user of package consumer sees
// only New, Run and Stats.
type pipeline struct{ c *Consumer }

var _ transport.Pipeline = pipeline{}

func (p pipeline) Settings() transport.PipelineSettings {
	cfg := p.c.cfg
	return transport.PipelineSettings{
		BatchSize: cfg.BatchSize, Concurrency: cfg.Concurrency, MaxAttempts: cfg.MaxAttempts,
		BackoffMax: cfg.BackoffMax, AtMostOnce: cfg.Mode == AtMostOnce, ShutdownTimeout: cfg.ShutdownTimeout,
		Logger: p.c.log,
	}
}

func (p pipeline) Handle(ctx context.Context, b *transport.Batch) ([]*transport.Settlement, error) {
	return p.c.handle(ctx, b)
}

func (p pipeline) Settled(ctx context.Context, s []*transport.Settlement) error {
	return p.c.settled(ctx, s)
}

func (p pipeline) Foreign(origin string, n int) { p.c.count(origin, resForeign, int64(n)) }

func (p pipeline) Held(delta int) { p.c.m.held.Add(float64(delta)) }

func (p pipeline) Lag(topic string, partition int32, n int64, oldest time.Time) {
	p.c.lag(topic, partition, n, oldest)
}

func (p pipeline) Crashed() <-chan struct{} { return p.c.crashCh }

func (p pipeline) Err() error { return p.c.Err() }
