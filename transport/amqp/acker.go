package amqp

import (
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// acker settles the deliveries of one consuming channel and coalesces acks:
// a handler's Ack only records the tag, and one goroutine sends
// basic.ack(multiple=true) for the longest prefix of tags that are all
// settled, so a burst of completions costs one frame instead of one each.
// No ack is sent for a tag before its handler asked for it (ack after the
// effect holds). Nack and Reject are sent at once. When more than maxHeld
// acks wait behind an unsettled tag (a slow handler), they are sent one by
// one, so a slow message never exhausts the prefetch window.
//
// RabbitMQ rejects a multiple ack whose own tag is not outstanding, so the
// multiple ack always names a tag whose ack was recorded and not yet sent.
type acker struct {
	ch      *amqp.Channel
	maxHeld int
	kick    chan struct{}

	mu   sync.Mutex
	low  uint64              // every tag below low is settled
	want map[uint64]struct{} // acks recorded, not sent (tags >= low)
	gone map[uint64]struct{} // settled one by one already (tags >= low)
}

var _ amqp.Acknowledger = (*acker)(nil)

func newAcker(ch *amqp.Channel, maxHeld int) *acker {
	return &acker{ch: ch, maxHeld: max(maxHeld, 1), kick: make(chan struct{}, 1), low: 1,
		want: map[uint64]struct{}{}, gone: map[uint64]struct{}{}}
}

// Ack records tag as done; run sends it. multiple is not supported by the
// handlers of this package and is treated as false.
func (a *acker) Ack(tag uint64, _ bool) error {
	a.mu.Lock()
	a.want[tag] = struct{}{}
	a.mu.Unlock()
	select {
	case a.kick <- struct{}{}:
	default:
	}
	return nil
}

// Nack sends basic.nack for tag now.
func (a *acker) Nack(tag uint64, _ bool, requeue bool) error {
	err := a.ch.Nack(tag, false, requeue)
	a.settled(tag)
	return err
}

// Reject sends basic.reject for tag now.
func (a *acker) Reject(tag uint64, requeue bool) error {
	err := a.ch.Reject(tag, requeue)
	a.settled(tag)
	return err
}

func (a *acker) settled(tag uint64) {
	a.mu.Lock()
	a.gone[tag] = struct{}{}
	a.mu.Unlock()
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// run flushes on every kick until stop is closed, then flushes what is left.
func (a *acker) run(stop <-chan struct{}) {
	for {
		select {
		case <-a.kick:
			a.flush(false)
		case <-stop:
			a.flush(true)
			return
		}
	}
}

// flush sends the multiple ack of the settled prefix and, if too many acks
// (or, with all, any) wait behind a gap, those acks one by one.
func (a *acker) flush(all bool) {
	a.mu.Lock()
	var multi uint64
	for {
		if _, ok := a.want[a.low]; ok {
			delete(a.want, a.low)
			multi = a.low
		} else if _, ok := a.gone[a.low]; ok {
			delete(a.gone, a.low)
		} else {
			break
		}
		a.low++
	}
	var singles []uint64
	if all || len(a.want) > a.maxHeld {
		for tag := range a.want {
			singles = append(singles, tag)
			a.gone[tag] = struct{}{}
		}
		clear(a.want)
	}
	a.mu.Unlock()
	if multi > 0 {
		_ = a.ch.Ack(multi, true)
	}
	for _, tag := range singles {
		_ = a.ch.Ack(tag, false)
	}
}
