package system

import (
	"context"
	"errors"
	"sort"
	"sync"
	"time"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
)

// supervisor runs relays and consumers and restarts them when they die.
type supervisor struct {
	s        *System
	mu       sync.Mutex
	restarts map[string]int // by worker name
	live     map[string]*consumer.Consumer
	past     map[string]consumer.Stats // counts of dead instances, by consumidor
	relays   map[string]lagger
	running  map[string]bool // workers whose goroutine has not returned
}

func (sv *supervisor) init(s *System) {
	sv.s = s
	sv.restarts = map[string]int{}
	sv.live = map[string]*consumer.Consumer{}
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
			if errors.Is(err, relay.ErrCrashed) || errors.Is(err, consumer.ErrCrashed) {
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
func (sv *supervisor) runRelay(service string, cfg relay.Config) {
	sv.run("relay "+service, func(ctx context.Context) error {
		r, err := relay.New(cfg)
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
func (sv *supervisor) runConsumer(cfg consumer.Config) {
	sv.run("consumer "+cfg.Group, func(ctx context.Context) error {
		c, err := consumer.New(cfg)
		if err != nil {
			return err
		}
		sv.mu.Lock()
		sv.live[cfg.Group] = c
		sv.mu.Unlock()
		err = c.Run(ctx)
		sv.mu.Lock()
		sv.past[cfg.Group] = add(sv.past[cfg.Group], c.Stats())
		delete(sv.live, cfg.Group)
		sv.mu.Unlock()
		return err
	})
}

func add(a, b consumer.Stats) consumer.Stats {
	return consumer.Stats{
		Processed: a.Processed + b.Processed, Duplicates: a.Duplicates + b.Duplicates, Ignored: a.Ignored + b.Ignored,
		Foreign: a.Foreign + b.Foreign, Retried: a.Retried + b.Retried, DeadLettered: a.DeadLettered + b.DeadLettered,
		Panics: a.Panics + b.Panics,
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
	for g, c := range sv.live {
		out[g] = add(out[g], c.Stats())
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
