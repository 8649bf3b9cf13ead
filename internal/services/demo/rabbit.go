package demo

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/amqp"
)

// rabbit is the demo's view of the domain events that travel over
// RabbitMQ: the run's own exchange and queue prefix (so that runs sharing a
// broker never read each other's events), and one audit queue per topic,
// bound with the topic name as a program of another language would bind
// it, which keeps a copy of everything the relays published: what reading
// a Kafka topic from the start gives.
type rabbit struct {
	conn     *amqp.Conn
	exchange string
	prefix   string
	audit    map[string]string // contract topic → its audit queue
}

// newRabbit connects and declares the exchange and the audit queues of
// topics, before the system starts (so they see every event).
func newRabbit(ctx context.Context, url, run string, topics []string, log *slog.Logger) (*rabbit, error) {
	conn, err := amqp.Dial(ctx, amqp.Config{URL: url, Name: "km0-demo", Logger: log})
	if err != nil {
		return nil, fmt.Errorf("demo: RabbitMQ: %w", err)
	}
	r := &rabbit{conn: conn, exchange: "km0.demo_" + run + ".esdeveniments", prefix: "demo_" + run + ".", audit: map[string]string{}}
	topo := amqp.Topology{Exchanges: []amqp.Exchange{{Name: r.exchange, Kind: "topic", Durable: true}}}
	for _, t := range topics {
		q := r.prefix + "auditoria." + t
		r.audit[t] = q
		topo.Queues = append(topo.Queues, amqp.Queue{Name: q, Durable: true})
		topo.Bindings = append(topo.Bindings, amqp.Binding{Queue: q, Exchange: r.exchange, Key: t}) // the topic name, as any reader binds
	}
	if err := conn.Declare(ctx, topo); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return r, nil
}

// configure puts the run's exchange and queue prefix in cfg.
func (r *rabbit) configure(cfg *system.Config) {
	cfg.EventsExchange = r.exchange
	cfg.EventsQueuePrefix = r.prefix
}

// drain takes every message in queue now, acked as read (the run ends).
func (r *rabbit) drain(ctx context.Context, queue string) ([]amqp091.Delivery, error) {
	var out []amqp091.Delivery
	err := r.conn.Do(ctx, func(ch *amqp091.Channel) error {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil || q.Messages == 0 {
			return err
		}
		if err := ch.Qos(500, 0, false); err != nil {
			return err
		}
		ds, err := ch.Consume(queue, "", false, false, false, false, nil)
		if err != nil {
			return err
		}
		idle := time.NewTimer(10 * time.Second)
		defer idle.Stop()
		for len(out) < q.Messages {
			select {
			case d, ok := <-ds:
				if !ok {
					return fmt.Errorf("reading %s: the channel closed", queue)
				}
				out = append(out, d)
				if len(out)%250 == 0 || len(out) == q.Messages {
					if err := d.Ack(true); err != nil {
						return err
					}
				}
				idle.Reset(10 * time.Second)
			case <-idle.C:
				return fmt.Errorf("reading %s: %d of %d messages after 10 s idle", queue, len(out), q.Messages)
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	return out, err
}

// eventIDs returns the id_esdeveniment of every message the relays
// published to topic (one per message, republications included).
func (r *rabbit) eventIDs(ctx context.Context, topic string) ([]string, error) {
	ds, err := r.drain(ctx, r.audit[topic])
	if err != nil {
		return nil, err
	}
	out := make([]string, len(ds))
	for i := range ds {
		m := amqp.FromDelivery(&ds[i])
		out[i], _ = m.Header(contract.HeaderEventID)
	}
	return out, nil
}

// deadLetters reads the DLQ of every consumer whose topics are on RabbitMQ.
// A copy km0 published (attempts exhausted) carries its motiu; a native
// nack (a permanent failure) does not, and its motiu comes from the
// consumer's own record (System.DeadLetterReasons), else the broker's
// x-death ("permanent: rejected by …").
func (r *rabbit) deadLetters(ctx context.Context, sys *system.System) ([]deadLetter, error) {
	reasons := sys.DeadLetterReasons()
	var out []deadLetter
	for _, name := range system.ConsumerNames {
		onRabbit := false
		for _, t := range system.Subscriptions[name] {
			onRabbit = onRabbit || sys.EventsBroker()[t] == system.EventsRabbitMQ
		}
		if !onRabbit {
			continue
		}
		queue := r.prefix + name
		ds, err := r.drain(ctx, contract.DLQName(queue))
		if err != nil {
			return nil, err
		}
		for i := range ds {
			d := &ds[i]
			m := amqp.FromDelivery(d)
			dl := deadLetter{topic: contract.DLQName(queue), group: name}
			dl.eventID, _ = m.Header(contract.HeaderEventID)
			dl.motiu, _ = m.Header(contract.HeaderReason)
			dl.motiu = cmp.Or(dl.motiu, reasons[name][dl.eventID], amqp.DeadLetterOf(queue, d).Reason)
			dl.orderID = orderOf(d.Body)
			out = append(out, dl)
		}
	}
	return out, nil
}

// orderOf is the order id of an event's envelope, or "".
func orderOf(value []byte) string {
	env, err := envelope.Decode(value)
	if err != nil {
		return ""
	}
	var d struct {
		ID      string `json:"id"`         // comanda.creada
		OrderID string `json:"comanda_id"` // comanda.pagada, pagament.confirmat
	}
	_ = json.Unmarshal(env.Data, &d)
	return cmp.Or(d.ID, d.OrderID)
}

// backlog counts the messages ready in the system's queues of the events
// (work, shard and wait queues; not the DLQs), naming the non-empty ones.
func (r *rabbit) backlog(ctx context.Context, sys *system.System) (int, []string, error) {
	total := 0
	var behind []string
	err := r.conn.Do(ctx, func(ch *amqp091.Channel) error {
		for _, q := range sys.EventQueues() {
			if strings.HasSuffix(q, contract.DLQSuffix) {
				continue
			}
			st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
			if err != nil {
				return err
			}
			if st.Messages > 0 {
				total += st.Messages
				behind = append(behind, fmt.Sprintf("%s %d", strings.TrimPrefix(q, r.prefix), st.Messages))
			}
		}
		return nil
	})
	return total, behind, err
}

// close deletes the run's queues (the system's and the audit queues) and its
// exchange, after the system stopped.
func (r *rabbit) close(ctx context.Context, sys *system.System) error {
	var queues []string
	if sys != nil {
		queues = sys.EventQueues()
	}
	for _, q := range r.audit {
		queues = append(queues, q)
	}
	var errs []error
	for _, q := range queues {
		err := r.conn.Do(ctx, func(ch *amqp091.Channel) error {
			_, err := ch.QueueDelete(q, false, false, false)
			return err
		})
		var aerr *amqp091.Error
		if !errors.As(err, &aerr) || aerr.Code != amqp091.NotFound {
			errs = append(errs, err) // an expired wait queue is gone already
		}
	}
	errs = append(errs, r.conn.Do(ctx, func(ch *amqp091.Channel) error { return ch.ExchangeDelete(r.exchange, false, false) }))
	errs = append(errs, r.conn.Close())
	return errors.Join(errs...)
}

// eventLog reads what the relays published and what the consumers
// dead-lettered: from the Kafka topics, or from the RabbitMQ audit and
// dead-letter queues, topic by topic as the run put them.
type eventLog struct {
	sys     *system.System
	kcl     *kgo.Client // nil without Kafka
	brokers []string
	rabbit  *rabbit // nil without RabbitMQ
}

func (e *eventLog) broker(topic string) string { return e.sys.EventsBroker()[topic] }

// onKafka reports whether consumidor name reads a topic on Kafka.
func (e *eventLog) onKafka(name string) bool {
	for _, t := range system.Subscriptions[name] {
		if e.broker(t) == system.EventsKafka {
			return true
		}
	}
	return false
}

// describe names the broker of the events for the report.
func (e *eventLog) describe() string {
	var rabbit []string
	for _, t := range slices.Sorted(maps.Keys(e.sys.EventsBroker())) {
		if e.broker(t) == system.EventsRabbitMQ {
			rabbit = append(rabbit, t)
		}
	}
	switch len(rabbit) {
	case 0:
		return "Kafka"
	case len(system.Topics):
		return "RabbitMQ"
	}
	return "Kafka; RabbitMQ: " + strings.Join(rabbit, ", ")
}

// eventIDs returns the id_esdeveniment of every event published to topic.
func (e *eventLog) eventIDs(ctx context.Context, topic string) ([]string, error) {
	if e.broker(topic) == system.EventsRabbitMQ {
		return e.rabbit.eventIDs(ctx, topic)
	}
	recs, err := readTopic(ctx, e.kcl, e.brokers, topic)
	if err != nil {
		return nil, err
	}
	out := make([]string, len(recs))
	for i, rec := range recs {
		out[i] = header(rec, contract.HeaderEventID)
	}
	return out, nil
}

// deadLetters returns every dead letter of the run, on both brokers.
func (e *eventLog) deadLetters(ctx context.Context) ([]deadLetter, error) {
	var dls []deadLetter
	for _, svcName := range []string{comandes.Name, inventari.Name, pagaments.Name, repartiment.Name} {
		if e.broker(system.Topics[svcName]) != system.EventsKafka {
			continue
		}
		topic := contract.DLQName(system.Topics[svcName])
		recs, err := readTopic(ctx, e.kcl, e.brokers, topic)
		if err != nil {
			return nil, err
		}
		for _, rec := range recs {
			dls = append(dls, deadLetter{topic: topic, group: header(rec, contract.HeaderGroup), motiu: header(rec, contract.HeaderReason),
				eventID: header(rec, contract.HeaderEventID), orderID: orderOf(rec.Value)})
		}
	}
	if e.rabbit != nil {
		more, err := e.rabbit.deadLetters(ctx, e.sys)
		if err != nil {
			return nil, err
		}
		dls = append(dls, more...)
	}
	return dls, nil
}
