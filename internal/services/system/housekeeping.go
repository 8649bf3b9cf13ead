package system

import (
	"context"
	"time"

	"github.com/km0/km0/inbox"
)

// purger deletes one kind of expired row and says how many it deleted.
type purger struct {
	what  string
	purge func(ctx context.Context) (int64, error)
}

// inboxPurger deletes the service's consumer keys older than KeyRetention:
// past the topics' retention no redelivery can arrive, so the keys are dead
// weight on every ON CONFLICT (CONTRACT.md: purged after 14 days).
func (s *System) inboxPurger(service string) purger {
	in := inbox.New(inbox.Config{Retention: s.cfg.KeyRetention})
	pool := s.pools[service]
	return purger{what: "missatges_processats", purge: func(ctx context.Context) (int64, error) { return in.Purge(ctx, pool) }}
}

// housekeep runs the purgers of service at start and then every
// PurgeInterval until the system stops. A failure is logged and tried again
// at the next tick.
func (s *System) housekeep(service string, purgers ...purger) {
	log := s.log.With("service", service)
	s.wg.Go(func() {
		t := time.NewTicker(s.cfg.PurgeInterval)
		defer t.Stop()
		for {
			for _, p := range purgers {
				n, err := p.purge(s.ctx)
				switch {
				case err != nil && s.ctx.Err() == nil:
					log.Warn("system: housekeeping", "taula", p.what, "err", err)
				case n > 0:
					log.Info("system: housekeeping: expired rows deleted", "taula", p.what, "files", n)
				}
			}
			select {
			case <-s.ctx.Done():
				return
			case <-t.C:
			}
		}
	})
}
