package system

import (
	"errors"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/migrate"
)

// MetricPaused is the gauge of the consumer groups an operator paused: 1
// while paused, 0 otherwise, labelled grup and servei.
const MetricPaused = "km0_consumer_paused"

// pausedGauge is registered once in prometheus.DefaultRegisterer (what the
// console's and km0 serve's /metrics gather).
var pausedGauge = sync.OnceValue(func() *prometheus.GaugeVec {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricPaused,
		Help: "1 while an operator has paused the consumer group (consumidors_pausats), by grup and servei."}, []string{"grup", "servei"})
	if err := prometheus.DefaultRegisterer.Register(g); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(*prometheus.GaugeVec); ok {
				return existing
			}
		}
	}
	return g
})

// pauses are the pause switches of a system's consumers, by service and
// consumer group; filled while Start starts the consumers, read-only after.
type pauses struct {
	mu sync.Mutex
	sw map[string]map[string]*consumer.Pause // service → grup → switch
}

// pauseFor returns the switch of group in service, reading the table once
// so that a group paused before the start takes no batch.
func (s *System) pauseFor(service, group string) *consumer.Pause {
	s.pause.mu.Lock()
	defer s.pause.mu.Unlock()
	if s.pause.sw == nil {
		s.pause.sw = map[string]map[string]*consumer.Pause{}
	}
	if s.pause.sw[service] == nil {
		s.pause.sw[service] = map[string]*consumer.Pause{}
	}
	if p := s.pause.sw[service][group]; p != nil {
		return p
	}
	p := &consumer.Pause{}
	if paused, err := consumer.PausedGroups(s.ctx, s.pools[service], migrate.SchemaDefault); err == nil {
		p.Set(slices.ContainsFunc(paused, func(g consumer.PausedGroup) bool { return g.Group == group }))
	}
	s.pause.sw[service][group] = p
	pausedGauge().WithLabelValues(group, service).Set(b2f(p.Paused()))
	if p.Paused() {
		s.log.Warn("system: consumer group paused by an operator: it takes no new batch", "service", service, "grup", group)
	}
	return p
}

// watchPauses starts, once Start has started every consumer, one watcher
// per service of its consumidors_pausats (consumer.WatchPauses).
func (s *System) watchPauses() {
	s.pause.mu.Lock()
	defer s.pause.mu.Unlock()
	for service, switches := range s.pause.sw {
		log := s.log.With("service", service)
		pool := s.pools[service]
		s.wg.Go(func() {
			consumer.WatchPauses(s.ctx, pool, migrate.SchemaDefault, consumer.PausePollDefault, switches,
				func(g string, paused bool) {
					pausedGauge().WithLabelValues(g, service).Set(b2f(paused))
					if paused {
						log.Warn("system: consumer group paused by an operator: it takes no new batch", "grup", g)
					} else {
						log.Info("system: consumer group resumed by an operator", "grup", g)
					}
				},
				func(err error) { log.Warn("system: reading the paused consumer groups", "err", err) })
		})
	}
}

// Groups returns the consumer groups of service's consumers, sorted.
func (s *System) Groups(service string) []string {
	s.pause.mu.Lock()
	defer s.pause.mu.Unlock()
	out := make([]string, 0, len(s.pause.sw[service]))
	for g := range s.pause.sw[service] {
		out = append(out, g)
	}
	slices.Sort(out)
	return out
}

// Paused returns the paused consumer groups of service, sorted.
func (s *System) Paused(service string) []string {
	s.pause.mu.Lock()
	defer s.pause.mu.Unlock()
	var out []string
	for g, p := range s.pause.sw[service] {
		if p.Paused() {
			out = append(out, g)
		}
	}
	slices.Sort(out)
	return out
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
