package demo

import (
	"context"
	"sync"
	"time"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// KafkaOutage is what happened while the embedded Kafka was unreachable
// (Config.KafkaDown): whether inventari, which publishes estoc.actualitzat
// to Kafka, kept taking stock for the orders that arrived meanwhile.
type KafkaOutage struct {
	Seconds float64 `json:"seconds"`
	// InventariReads is the broker of comandes.esdeveniments, where
	// inventari reads its orders.
	InventariReads string `json:"inventari_reads"`
	// StockEvents are the estoc.actualitzat inventari wrote while Kafka was
	// down (each an order line it took from stock).
	StockEvents int `json:"stock_events_during"`
	// InventariPending and ComandesPending are the outbox rows waiting for
	// the broker when Kafka came back.
	InventariPending int `json:"inventari_outbox_pending"`
	ComandesPending  int `json:"comandes_outbox_pending"`
}

// outage takes Kafka down for d when start is called, and measures it.
type outage struct {
	d      time.Duration
	broker *kafkaembed.Broker
	sys    *system.System
	say    func(string, ...any)
	once   sync.Once
	done   chan struct{}
	res    KafkaOutage
}

func newOutage(d time.Duration, broker *kafkaembed.Broker, sys *system.System, say func(string, ...any)) *outage {
	return &outage{d: d, broker: broker, sys: sys, say: say, done: make(chan struct{}),
		res: KafkaOutage{Seconds: d.Seconds(), InventariReads: sys.EventsBroker()[comandes.Topic]}}
}

const stockEventsSQL = `SELECT count(*) FROM outbox WHERE tipus = 'estoc.actualitzat' AND carrega->>'motiu' = 'comanda'`

// start begins the outage once, in the background.
func (o *outage) start(ctx context.Context) {
	o.once.Do(func() {
		go func() {
			defer close(o.done)
			inv := o.sys.Pool(inventari.Name)
			before, _ := countOf(ctx, inv, stockEventsSQL)
			up := o.broker.Unreachable()
			o.say("Kafka down for %v (inventari reads the orders from %s)", o.d, brokerName(o.res.InventariReads))
			select {
			case <-time.After(o.d):
			case <-ctx.Done():
			}
			after, _ := countOf(ctx, inv, stockEventsSQL)
			o.res.StockEvents = after - before
			o.res.InventariPending, _ = countOf(ctx, inv, `SELECT count(*) FROM outbox WHERE publicat_en IS NULL`)
			o.res.ComandesPending, _ = countOf(ctx, o.sys.Pool(comandes.Name), `SELECT count(*) FROM outbox WHERE publicat_en IS NULL`)
			up()
			o.say("Kafka is back: during the outage inventari wrote %d stock events; pending in the outboxes: inventari %d, comandes %d",
				o.res.StockEvents, o.res.InventariPending, o.res.ComandesPending)
		}()
	})
}

// wait waits for the outage to end (started or not: then it starts now).
func (o *outage) wait(ctx context.Context) {
	o.start(ctx)
	select {
	case <-o.done:
	case <-ctx.Done():
	}
}

// check adds the outage's invariant: over RabbitMQ inventari kept taking
// stock and its events waited in its outbox; over Kafka it stopped and the
// orders waited in comandes' outbox. That nothing was lost either way is
// what the report's other invariants check once the system settled.
func (o *outage) check(r *Report) {
	res := o.res
	r.KafkaOutage = &res
	if res.InventariReads == system.EventsRabbitMQ {
		r.check("Kafka down, inventari carries on: it reads RabbitMQ, its events wait in its outbox", res.StockEvents > 0 && res.InventariPending > 0,
			"%.0f s without Kafka: %d stock events written, %d pending in inventari's outbox when it came back", res.Seconds, res.StockEvents, res.InventariPending)
		return
	}
	r.check("Kafka down, inventari stops: it reads Kafka, the orders wait in comandes' outbox", res.ComandesPending > 0,
		"%.0f s without Kafka: %d stock events written (those it already had), %d pending in comandes' outbox when it came back", res.Seconds, res.StockEvents, res.ComandesPending)
}
