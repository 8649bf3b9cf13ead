package amqp

import (
	"context"
	"errors"
	"log/slog"
	"runtime"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Defaults of SubscribeConfig.
const (
	PrefetchDefault = 32
	WorkersDefault  = 1
)

// SubscribeConfig configures Conn.Subscribe.
type SubscribeConfig struct {
	Queue string // required
	// Prefetch is the channel's basic.qos: unacknowledged deliveries the
	// broker may push. Default 32.
	Prefetch int
	// Workers is how many deliveries are handled at once. Default 1, which
	// keeps the queue's order (with x-single-active-consumer, per queue).
	Workers int
	// Logger. Default slog.Default().
	Logger *slog.Logger
}

// Subscribe consumes cfg.Queue with manual acks until ctx ends, calling fn
// for each delivery from cfg.Workers goroutines. fn must ack or nack the
// delivery; what it leaves unacknowledged is requeued by the broker when the
// channel closes. Acks are coalesced (see acker): d.Ack records the ack and
// one goroutine sends basic.ack(multiple) for each run of settled tags. When the channel or the connection fails, Subscribe opens
// a new channel (waiting for the Conn to reconnect) and consumes again: the
// unacknowledged deliveries come back marked redelivered. On ctx end the
// workers take no new delivery and finish the ones they hold; then the
// channel closes (without a basic.cancel first, which on a single-active-
// consumer queue would let the next consumer overtake what this channel
// still held) and Subscribe returns nil. It returns ErrConnClosed if the
// Conn is closed.
func (c *Conn) Subscribe(ctx context.Context, cfg SubscribeConfig, fn func(ctx context.Context, d *amqp.Delivery)) error {
	return c.subscribe(ctx, cfg, 1, func(ctx context.Context, ds []*amqp.Delivery) { fn(ctx, ds[0]) })
}

// subscribe is Subscribe handing each worker up to batch deliveries at a
// time: the one it waited for and those already buffered behind it, in
// their order.
func (c *Conn) subscribe(ctx context.Context, cfg SubscribeConfig, batch int, fn func(ctx context.Context, ds []*amqp.Delivery)) error {
	if cfg.Queue == "" {
		return errors.New("amqp: Subscribe: empty queue name")
	}
	if cfg.Prefetch <= 0 {
		cfg.Prefetch = PrefetchDefault
	}
	if cfg.Workers <= 0 {
		cfg.Workers = WorkersDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = c.log
	}
	var fails int // consecutive interruptions: the backoff's count
	for {
		if ctx.Err() != nil {
			return nil
		}
		ch, err := c.Channel(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		err = c.consumeOnce(ctx, ch, cfg, max(batch, 1), fn)
		_ = ch.Close()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			cfg.Logger.Warn("amqp: consumer interrupted; subscribing again", "queue", cfg.Queue, "err", err)
			var aerr *amqp.Error
			if errors.As(err, &aerr) && aerr.Code == amqp.NotFound {
				// The queue was deleted under us: declare it again, with
				// the rest of its registered topology (dead-lettering).
				if ok, derr := c.redeclareQueue(ctx, cfg.Queue); derr != nil {
					cfg.Logger.Error("amqp: cannot declare the deleted queue again", "queue", cfg.Queue, "err", derr)
				} else if ok {
					cfg.Logger.Warn("amqp: queue was deleted; declared it again", "queue", cfg.Queue)
				}
			}
			fails++
			select {
			case <-time.After(c.backoff(fails)):
			case <-ctx.Done():
				return nil
			}
			continue
		}
		fails = 0
	}
}

// consumeOnce consumes on ch until the deliveries stop (channel closed,
// consumer cancelled) or ctx ends.
func (c *Conn) consumeOnce(ctx context.Context, ch *amqp.Channel, cfg SubscribeConfig, batch int, fn func(context.Context, []*amqp.Delivery)) error {
	if err := ch.Qos(cfg.Prefetch, 0, false); err != nil {
		return err
	}
	tag := "km0-" + randomTag()
	deliveries, err := ch.Consume(cfg.Queue, tag, false, false, false, false, nil)
	if err != nil {
		return err
	}
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	ack := newAcker(ch, cfg.Prefetch/2)
	ackStop, ackDone := make(chan struct{}), make(chan struct{})
	go func() { ack.run(ackStop); close(ackDone) }()
	defer func() { close(ackStop); <-ackDone }() // the last acks go before the channel closes
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case d, ok := <-deliveries:
					if !ok {
						return
					}
					d.Acknowledger = ack
					ds := []*amqp.Delivery{&d}
					// Take what the client library already holds, without
					// waiting for more: amqp091-go hands deliveries over one
					// at a time from a goroutine, so a failed take yields
					// once to let it offer the next before giving up.
					yielded := false
				more:
					for len(ds) < batch {
						select {
						case d, ok := <-deliveries:
							if !ok {
								break more
							}
							d.Acknowledger = ack
							ds = append(ds, &d)
							yielded = false
						default:
							if yielded {
								break more
							}
							yielded = true
							runtime.Gosched()
						}
					}
					fn(ctx, ds)
				case <-stop:
					return
				}
			}
		}()
	}
	workersDone := make(chan struct{})
	go func() { wg.Wait(); close(workersDone) }()
	var cause error
	select {
	case <-ctx.Done():
		// Stop taking new deliveries; the workers finish the ones they
		// hold, and the caller closes the channel. No basic.cancel first:
		// on a queue with x-single-active-consumer, a cancel activates the
		// next consumer at once, while the deliveries pushed to this
		// channel and not yet handled are still held here; it would take
		// the messages behind them, later events of their keys, first.
		// Closing the channel requeues them in place before the queue
		// activates the next consumer.
		close(stop)
		<-workersDone
		return nil
	case e := <-closes:
		if e != nil {
			cause = e
		} else {
			cause = ErrChannelLost
		}
	case <-workersDone:
		cause = errors.New("amqp: consumer cancelled by the broker (queue deleted?)")
	}
	close(stop)
	<-workersDone
	return cause
}
