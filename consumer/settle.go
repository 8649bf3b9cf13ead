package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
)

// decide turns failed attempts into what the source must do, the same on
// every broker: a permanent failure, or a transient one on its last attempt
// (MaxAttempts), is dead-lettered with motiu "permanent: …" or "transitori
// esgotat: …"; any other transient failure is retried after its delay (a
// RetryAfter delay, else Backoff × 2^(attempt−1)), capped by BackoffMax.
func (c *Consumer) decide(fails []failure) []*transport.Settlement {
	if len(fails) == 0 {
		return nil
	}
	now := time.Now()
	out := make([]*transport.Settlement, len(fails))
	for i, f := range fails {
		var pe *PanicError
		s := &transport.Settlement{
			D: f.it.d, Err: f.err, Panic: errors.As(f.err, &pe), Ref: f.it.msg,
			LastError: outcome.Truncate(errText(f.err), 200),
			Permanent: f.kind == outcome.KindPermanent,
		}
		if f.on != nil { // a message of the per-key order store, carried by the delivery in hand
			s.D, s.Copy = f.on, f.it.d
		}
		switch {
		case f.reason != "":
			s.Dead, s.Reason, s.Permanent = true, f.reason, true
			if f.err == nil {
				s.LastError = f.reason
			}
		case c.dead(f):
			s.Dead, s.Reason = true, outcome.Reason(f.kind, f.err)
		default:
			wait := min(f.wait, c.cfg.BackoffMax) // a RetryAfter delay too: what a reader trusts
			if wait <= 0 {
				wait = outcome.Backoff(c.cfg.Backoff, c.cfg.BackoffMax, f.it.msg.Attempt)
			}
			s.Delay, s.NotBefore = wait, now.Add(wait)
		}
		out[i] = s
	}
	return out
}

// dead reports whether f is dead-lettered (else retried): a permanent
// failure, a forced motiu, or a transient one on its last attempt.
func (c *Consumer) dead(f failure) bool {
	return f.reason != "" || f.kind == outcome.KindPermanent || f.it.msg.Attempt >= c.cfg.MaxAttempts
}

// settled counts, logs and observes the settlements a source carried out,
// then runs the BeforeSourceCommit crash point.
func (c *Consumer) settled(ctx context.Context, ss []*transport.Settlement) error {
	if len(ss) == 0 {
		return nil
	}
	for _, s := range ss {
		m, _ := s.Ref.(*Message)
		if m == nil {
			m = &Message{Message: s.D.Message, OriginalTopic: s.D.Origin, Partition: s.D.Partition, Offset: s.D.Offset, Attempt: s.D.Attempt}
		}
		if s.Panic {
			c.counts[resPanic].Add(1)
		}
		if !s.Dead {
			c.count(s.D.Origin, resRetried, 1)
			c.log.Info("consumer: retry scheduled", "id", eventID(m), "topic", s.D.Origin,
				"intents", m.Attempt, "no_abans", contract.FormatTime(s.NotBefore), "err", errText(s.Err))
			continue
		}
		c.count(s.D.Origin, resDLQ, 1)
		c.m.dlq.WithLabelValues(s.D.Origin, contract.ReasonClass(s.Reason)).Inc()
		c.log.Error("consumer: dead letter", "id", eventID(m), "motiu", s.Reason, "topic", s.D.Origin,
			"partition", s.D.Partition, "offset", s.D.Offset, "intents", m.Attempt, "dlq", contract.DLQName(s.D.Origin))
		if c.cfg.OnDeadLetter != nil {
			c.cfg.OnDeadLetter(ctx, m, s.Reason)
		}
	}
	if h := c.faults.BeforeSourceCommit; h != nil {
		return c.hook(h(ctx, len(ss)))
	}
	return nil
}

func errText(err error) string {
	if err == nil {
		return "?"
	}
	return err.Error()
}

// eventID is the id_esdeveniment of m: from the envelope, else the header
// (a message that did not decode), else "?".
func eventID(m *Message) string {
	if m.Envelope != nil {
		return m.Envelope.ID
	}
	if id, ok := m.Header(contract.HeaderEventID); ok {
		return id
	}
	return "?"
}
