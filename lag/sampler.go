package lag

import (
	"cmp"
	"context"
	"log/slog"
	"sync"
	"time"
)

// Defaults of SamplerConfig.
const (
	IntervalDefault = 15 * time.Second
	WindowDefault   = time.Hour
)

// SamplerConfig configures a Sampler.
type SamplerConfig struct {
	Measurer *Measurer // required
	// Interval between two measurements. Default IntervalDefault.
	Interval time.Duration
	// Window is how much history is kept. Default WindowDefault (an hour).
	Window time.Duration
	// Watch, if set, evaluates every snapshot (lag alerts).
	Watch  *Watch
	Logger *slog.Logger
}

// Point is one sample of the history: the headline numbers of a Snapshot.
type Point struct {
	At       time.Time        `json:"en"`
	Groups   map[string]int64 `json:"grups"`                  // total lag by group of the system
	Others   map[string]int64 `json:"altres_grups,omitempty"` // total lag by foreign group (Config.AllGroups)
	Outboxes map[string]int64 `json:"outboxes"`               // pending rows by outbox
	Queues   map[string]int64 `json:"cues"`                   // ready messages by queue
}

// Sampler measures every Interval and keeps the latest Snapshot and the
// last Window of Points. Safe for concurrent use.
type Sampler struct {
	cfg SamplerConfig

	mu     sync.Mutex
	latest *Snapshot
	points []Point
}

// NewSampler returns a Sampler; Run starts it.
func NewSampler(cfg SamplerConfig) *Sampler {
	cfg.Interval = cmp.Or(cfg.Interval, IntervalDefault)
	cfg.Window = cmp.Or(cfg.Window, WindowDefault)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Sampler{cfg: cfg}
}

// Run samples now and then every Interval until ctx ends; it returns nil then.
func (s *Sampler) Run(ctx context.Context) error {
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		if _, err := s.Sample(ctx); err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("lag: sample", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Sample measures once, records the snapshot and evaluates the Watch.
func (s *Sampler) Sample(ctx context.Context) (*Snapshot, error) {
	snap, err := s.cfg.Measurer.Measure(ctx)
	if err != nil {
		return nil, err
	}
	s.Add(snap)
	if s.cfg.Watch != nil {
		s.cfg.Watch.Evaluate(ctx, snap)
	}
	return snap, nil
}

// Add records snap as the latest and appends its Point, dropping points
// older than Window.
func (s *Sampler) Add(snap *Snapshot) {
	p := Point{At: snap.At, Groups: map[string]int64{}, Outboxes: map[string]int64{}, Queues: map[string]int64{}}
	for _, g := range snap.Groups {
		switch {
		case !g.Foreign:
			p.Groups[g.Group] = g.Total
		case p.Others == nil:
			p.Others = map[string]int64{g.Group: g.Total}
		default:
			p.Others[g.Group] = g.Total
		}
	}
	for _, o := range snap.Outboxes {
		p.Outboxes[o.Name] = o.Pending
	}
	for _, q := range snap.Queues {
		p.Queues[q.Queue] = int64(q.Ready)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.latest = snap
	s.points = append(s.points, p)
	cut := snap.At.Add(-s.cfg.Window)
	i := 0
	for i < len(s.points) && s.points[i].At.Before(cut) {
		i++
	}
	s.points = s.points[i:]
}

// Latest returns the latest snapshot, or nil before the first.
func (s *Sampler) Latest() *Snapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.latest
}

// History returns the points of the last Window, oldest first, with their
// foreign groups (Point.Others).
func (s *Sampler) History() []Point {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Point(nil), s.points...)
}

// WithoutForeign returns points without their foreign groups (Point.Others):
// what is shown by default. points is not modified.
func WithoutForeign(points []Point) []Point {
	out := make([]Point, len(points))
	for i, p := range points {
		p.Others = nil
		out[i] = p
	}
	return out
}
