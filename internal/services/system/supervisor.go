package system

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

// supervisor runs relays and consumers and restarts them when they die.
type supervisor struct {
	s        *System
	mu       sync.Mutex
	restarts map[string]int            // by worker name
	live     map[string]liveConsumer   // by worker name
	past     map[string]consumer.Stats // counts of dead instances, by consumer group
	relays   map[string]lagger
	running  map[string]bool // workers whose goroutine has not returned
	queues   map[string]bool // RabbitMQ queues of the events declared so far
}

// liveConsumer is a running consumer instance, on either broker.
type liveConsumer struct {
	group  string
	c      *consumer.Consumer
	queues func() []string // nil on Kafka
}

func (sv *supervisor) init(s *System) {
	sv.s = s
	sv.restarts = map[string]int{}
	sv.live = map[string]liveConsumer{}
	sv.queues = map[string]bool{}
	sv.past = map[string]consumer.Stats{}
	sv.relays = map[string]lagger{}
	sv.running = map[string]bool{}
}

// stillRunning names the workers that have not returned yet.
func (sv *supervisor) stillRunning() []string {
	sv.mu.Lock()
	defer sv.mu.Unlock()
	var out []string
	for n := range sv.running {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// run calls start until the system stops, restarting it after
// Config.RestartDelay whenever it returns (a crash, injected or not).
func (sv *supervisor) run(name string, start func(ctx context.Context) error) {
	s := sv.s
	sv.mu.Lock()
	sv.running[name] = true
	sv.mu.Unlock()
	s.wg.Go(func() {
		defer func() {
			sv.mu.Lock()
			delete(sv.running, name)
			sv.mu.Unlock()
		}()
		for {
			err := start(s.ctx)
			if s.ctx.Err() != nil {
				return
			}
			sv.mu.Lock()
			sv.restarts[name]++
			n := sv.restarts[name]
			sv.mu.Unlock()
			level := s.log.Warn
			if errors.Is(err, faults.ErrCrashed) {
				level = s.log.Info
			}
			level("system: worker died; restarting", "worker", name, "restart", n, "err", err)
			select {
			case <-s.ctx.Done():
				return
			case <-time.After(s.cfg.RestartDelay):
			}
		}
	})
}

// runRelay supervises the outbox relay of service.
func (sv *supervisor) runRelay(service string, probes faults.Relay, cfg relay.Config) {
	sv.run("relay "+service, func(ctx context.Context) error {
		r, err := relay.New(cfg)
		if err != nil {
			return err
		}
		defer r.Close()
		sv.mu.Lock()
		sv.relays[service] = r
		sv.mu.Unlock()
		return r.Run(faults.WithRelay(ctx, probes))
	})
}

// lagger is a relay of either mode.
type lagger interface {
	Lag(ctx context.Context) (relay.Lag, error)
}

// runCDCRelay supervises the CDC relay of service.
func (sv *supervisor) runCDCRelay(service string, cfg cdc.Config) {
	sv.run("relay "+service, func(ctx context.Context) error {
		r, err := cdc.New(cfg)
		if err != nil {
			return err
		}
		defer r.Close()
		sv.mu.Lock()
		sv.relays[service] = r
		sv.mu.Unlock()
		return r.Run(ctx)
	})
}

// runConsumer supervises one consumer; Stats survive restarts.
// Each start gets a new Kafka source of src (a source runs once).
func (sv *supervisor) runConsumer(src kafka.SourceConfig, probes faults.Consumer[*consumer.Message], cfg consumer.Config) {
	worker := "consumer " + src.Group
	sv.run(worker, func(ctx context.Context) error {
		s, err := kafka.NewSource(src)
		if err != nil {
			return err
		}
		cfg.Source = s
		return sv.runOnce(ctx, worker, src.Group, nil, probes, cfg)
	})
}

// runAMQPConsumer supervises one RabbitMQ consumer of group; Stats survive
// restarts. Each start gets a new source of src, which declares its
// topology again.
func (sv *supervisor) runAMQPConsumer(worker, group string, src amqp.SourceConfig, probes faults.Consumer[*consumer.Message], cfg consumer.Config) {
	sv.run(worker, func(ctx context.Context) error {
		source, err := amqp.NewSource(ctx, src)
		if err != nil {
			return err
		}
		cfg.Source = source
		err = sv.runOnce(ctx, worker, group, source.Queues, probes, cfg)
		sv.noteQueues(source.Queues())
		return err
	})
}

// runOnce runs one consumer instance of cfg to its end.
func (sv *supervisor) runOnce(ctx context.Context, worker, group string, queues func() []string, probes faults.Consumer[*consumer.Message], cfg consumer.Config) error {
	c, err := consumer.New(cfg)
	if err != nil {
		return err
	}
	sv.mu.Lock()
	sv.live[worker] = liveConsumer{group: group, c: c, queues: queues}
	sv.mu.Unlock()
	err = c.Run(faults.WithPayments(faults.WithConsumer(ctx, probes), sv.s.cfg.PaymentFaults))
	sv.mu.Lock()
	sv.past[group] = add(sv.past[group], c.Stats())
	delete(sv.live, worker)
	sv.mu.Unlock()
	return err
}

// noteQueues records declared RabbitMQ queues (EventQueues).
func (sv *supervisor) noteQueues(names []string) {
	sv.mu.Lock()
	defer sv.mu.Unlock()
	for _, q := range names {
		sv.queues[q] = true
	}
}

// EventQueues returns the RabbitMQ queues of the events this process
// declared: every consumer's work or shard queues and DLQ, and the wait
// queues its consumers used. Nil when no event travels over RabbitMQ.
func (s *System) EventQueues() []string {
	sv := &s.sup
	sv.mu.Lock()
	defer sv.mu.Unlock()
	set := maps.Clone(sv.queues)
	for _, l := range sv.live {
		if l.queues != nil {
			for _, q := range l.queues() {
				set[q] = true
			}
		}
	}
	return slices.Sorted(maps.Keys(set))
}

func add(a, b consumer.Stats) consumer.Stats {
	return consumer.Stats{
		Processed: a.Processed + b.Processed, Duplicates: a.Duplicates + b.Duplicates, Ignored: a.Ignored + b.Ignored,
		Foreign: a.Foreign + b.Foreign, Retried: a.Retried + b.Retried, DeadLettered: a.DeadLettered + b.DeadLettered,
		Panics: a.Panics + b.Panics, Conflicts: a.Conflicts + b.Conflicts, Parked: a.Parked + b.Parked, Released: a.Released + b.Released,
	}
}

// ConsumerStats returns each consumer's counts since Start, by consumer group
// (= consumidor), summed over restarts.
func (s *System) ConsumerStats() map[string]consumer.Stats {
	sv := &s.sup
	sv.mu.Lock()
	defer sv.mu.Unlock()
	out := map[string]consumer.Stats{}
	for g, st := range sv.past {
		out[g] = st
	}
	for _, l := range sv.live {
		out[l.group] = add(out[l.group], l.c.Stats())
	}
	return out
}

// Restarts returns how many times each relay or consumer was restarted.
func (s *System) Restarts() map[string]int {
	sv := &s.sup
	sv.mu.Lock()
	defer sv.mu.Unlock()
	out := map[string]int{}
	for k, v := range sv.restarts {
		out[k] = v
	}
	return out
}

// RelayLag returns the pending outbox rows of each publishing service.
func (s *System) RelayLag(ctx context.Context) (map[string]relay.Lag, error) {
	sv := &s.sup
	sv.mu.Lock()
	relays := make(map[string]lagger, len(sv.relays))
	for k, v := range sv.relays {
		relays[k] = v
	}
	sv.mu.Unlock()
	out := map[string]relay.Lag{}
	for name, r := range relays {
		l, err := r.Lag(ctx)
		if err != nil {
			return nil, err
		}
		out[name] = l
	}
	return out, nil
}
