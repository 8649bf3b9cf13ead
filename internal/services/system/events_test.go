package system_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/amqp"
)

// rabbitEvents makes a config carry every domain event over the machine's
// RabbitMQ, on a vhost of the test's own (amqptest.VHost: request/reply's
// fixed queues, km0.dlx and the events' exchange and queues are the test's
// alone, and go with the vhost when the test ends), and no Kafka at all. The
// func it returns closes the system at cleanup, before the vhost goes.
func rabbitEvents(t *testing.T, c *system.Config) func(*system.System) {
	t.Helper()
	prefix := amqptest.Name("km0.test.ev")
	c.Brokers = nil
	c.Events = system.EventsRabbitMQ
	c.AMQPURL = amqptest.VHost(t)
	c.EventsExchange = prefix + ".esdeveniments"
	c.EventsQueuePrefix = prefix + "."
	return func(sys *system.System) { t.Cleanup(sys.Close) }
}

// The six services with their domain events on RabbitMQ and no Kafka: 120
// orders (one asks for more cheese than there is) go through inventari,
// pagaments, comandes, repartiment, analitica and cataleg, while inventari's
// consumer is killed once between its COMMIT and its ack. The end state in
// numbers: stock = initial − accepted, each (order, product) decremented
// once, the redelivered message absorbed as a duplicate, every order charged
// once, every other order paid and assigned, the cheese order in
// inventari's DLQ with its motiu and then cancelled and refunded (the
// compensation),
// cataleg's units equal to inventari's (per-key order kept), analitica's
// counts exact.
func TestSixServicesCarryTheirEventsOverRabbitMQ(t *testing.T) {
	t.Parallel()
	var cleanup func(*system.System)
	var crashed atomic.Bool
	var reader, amqpURL string
	sys, _ := startWith(t, system.Services, func(c *system.Config) {
		cleanup = rabbitEvents(t, c)
		amqpURL = c.AMQPURL
		reader = foreignReader(t, amqpURL, c.EventsExchange, comandes.Topic)
		c.Backoff = 50 * time.Millisecond
		c.AssignInterval = 50 * time.Millisecond
		c.DeliveryTime = time.Millisecond
		var committed atomic.Int64
		c.ConsumerFaults = map[string]faults.Consumer[*consumer.Message]{inventari.ConsumerDecrement: {AfterCommit: func(_ context.Context, msgs []*consumer.Message) error {
			if committed.Add(int64(len(msgs))) >= 40 && crashed.CompareAndSwap(false, true) {
				return faults.ErrCrashed
			}
			return nil
		}}}
	})
	cleanup(sys)
	if sys.RequestReplyTransport() != "RabbitMQ" {
		t.Fatalf("request/reply over %s", sys.RequestReplyTransport())
	}
	const orders = 120
	base := sys.Addrs()[comandes.Name]
	want := map[string]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := w; i < orders; i += 4 {
				prod := []string{"tomaquet-rosa", "carbasso", "vi-crianca"}[i%3]
				q := 1 + i%2
				if i == 7 {
					prod, q = "formatge-curat", 6 // 5 in stock: dead-lettered
				}
				body := fmt.Sprintf(`{"id":"P-2026-%06d","client":"c%d","mercat":"girona","linies":[{"producte":%q,"quantitat":%d,"preu_centims":250}],`+
					`"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`, i, i, prod, q)
				if r := postOrder(t, base, fmt.Sprintf("k-%d", i), body); r.status != http.StatusCreated {
					t.Errorf("order %d: %d %s", i, r.status, r.body)
					continue
				}
				if prod != "formatge-curat" {
					mu.Lock()
					want[prod] += q
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	ctx := context.Background()
	count := func(service, q string) int {
		var n int
		if err := sys.Pool(service).QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventuallyf(t, 60*time.Second, "every order settled", func() (bool, string) {
		paid := count(comandes.Name, `SELECT count(*) FROM comandes WHERE estat = 'pagada'`)
		sum, err := sys.Repartiment.Summary(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pending := 0
		for _, s := range []string{comandes.Name, inventari.Name, repartiment.Name} {
			pending += count(s, `SELECT count(*) FROM outbox WHERE publicat_en IS NULL`)
		}
		c, err := sys.Analitica.Counters(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// The cheese order is refused for stock, then cancelled and refunded
		// (the compensation): paid and assigned, or not, before its
		// cancellation, it ends cancelled with its courier free.
		counted := c.PerType["estoc.actualitzat"] == orders-1 && c.PerType["comanda.cancellada"] == 1 && c.PerType["estoc.refusat"] == 1 &&
			c.PerType["comanda.pagada"] >= orders-1 && c.PerType["repartiment.assignat"] >= orders-1
		for _, tipus := range []string{"comanda.creada", "pagament.confirmat"} {
			counted = counted && c.PerType[tipus] == orders
		}
		cancelled := count(comandes.Name, `SELECT count(*) FROM comandes WHERE estat = 'cancellada' AND motiu_cancellacio = 'estoc_insuficient'`)
		refunded := count(pagaments.Name, `SELECT count(*) FROM reemborsaments WHERE comanda_id = 'P-2026-000007'`)
		if paid == orders-1 && cancelled == 1 && refunded == 1 && sum[repartiment.StateAssigned] == orders-1 && pending == 0 && counted &&
			sys.ConsumerStats()[inventari.ConsumerDecrement].DeadLettered == 1 {
			return true, ""
		}
		return false, fmt.Sprintf("%d paid, %v deliveries, %d outbox rows pending, analitica %v, stats %+v",
			paid, sum, pending, c.PerType, sys.ConsumerStats())
	})

	stock, err := sys.Inventari.Stock(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for prod, n := range want {
		if stock[prod] != inventari.InitialStock[prod]-n {
			t.Errorf("%s: %d units, want %d − %d", prod, stock[prod], inventari.InitialStock[prod], n)
		}
	}
	if stock["formatge-curat"] != 5 {
		t.Errorf("formatge-curat: %d units, want 5 (the order for 6 refused)", stock["formatge-curat"])
	}
	if n := count(inventari.Name, `SELECT count(*) FROM (SELECT 1 FROM outbox WHERE tipus = 'estoc.actualitzat'
		GROUP BY carrega->>'comanda_id', carrega->>'producte' HAVING count(*) > 1) d`); n != 0 {
		t.Errorf("%d (order, product) pairs decremented twice", n)
	}
	if n := count(inventari.Name, `SELECT count(*) FROM outbox WHERE tipus = 'estoc.actualitzat'`); n != orders-1 {
		t.Errorf("%d stock decrements, want %d (one per accepted order)", n, orders-1)
	}
	st := sys.ConsumerStats()
	inv := st[inventari.ConsumerDecrement]
	// The crashed batch's effects are committed (processed); its redelivery
	// is absorbed as duplicates. The crash also cancels the batches other
	// shards hold: one whose COMMIT the cancellation raced is committed yet
	// not counted, and absorbed as duplicates too. So processed ≤ orders (the
	// accepted orders and the cheese order's cancellation) and processed +
	// duplicates ≥ orders; the effects are exact (above).
	if !crashed.Load() || sys.Restarts()["consumer "+inventari.ConsumerDecrement] < 1 || inv.Duplicates < 1 ||
		inv.Processed > orders || inv.Processed+inv.Duplicates < orders {
		t.Errorf("crash between COMMIT and ack: fired %v, %d restart(s), stats %+v: want ≥ 1 restart, ≥ 1 duplicate, %d processed or duplicates",
			crashed.Load(), sys.Restarts()["consumer "+inventari.ConsumerDecrement], inv, orders)
	}
	payments, err := sys.Pagaments.Payments(ctx)
	if err != nil {
		t.Fatal(err)
	}
	charges, err := sys.Gateway.Charges(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(payments) != orders || len(charges) != orders {
		t.Errorf("%d payments and %d gateway charges, want %d each", len(payments), len(charges), orders)
	}
	c, err := sys.Analitica.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for tipus, n := range map[string]int64{"comanda.creada": orders, "pagament.confirmat": orders, "comanda.cancellada": 1} {
		if c.PerType[tipus] != n {
			t.Errorf("analitica counted %d %s, want %d", c.PerType[tipus], tipus, n)
		}
	}
	// Per-key order: cataleg's last write of each product is inventari's
	// last stock, though every order's estoc.actualitzat races the others.
	flags, err := sys.Cataleg.Flags(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(flags) != len(want) {
		t.Errorf("cataleg flags %v, want one per product sold", flags)
	}
	for _, f := range flags {
		if f.Units != stock[f.Product] || f.LowStock != (f.Units < cataleg.LowStockBelow) {
			t.Errorf("cataleg %+v, inventari has %d", f, stock[f.Product])
		}
	}
	// The cheese order is in inventari's DLQ on the broker, and its motiu is known.
	reasons := sys.DeadLetterReasons()[inventari.ConsumerDecrement]
	if len(reasons) != 1 {
		t.Errorf("dead-letter reasons %v, want the cheese order's", reasons)
	}
	for _, m := range reasons {
		if !strings.HasPrefix(m, "permanent: "+inventari.ErrInsufficient.Error()) {
			t.Errorf("motiu %q", m)
		}
	}
	conn := amqptest.DialURL(t, amqpURL)
	// A reader of another language binds a queue with the bare topic name:
	// it receives every event of comandes' outbox (republications may repeat one).
	var ids []string
	r, err := sys.Pool(comandes.Name).Query(ctx, `SELECT id::text FROM outbox`)
	if err == nil {
		ids, err = pgx.CollectRows(r, pgx.RowTo[string])
	}
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	err = conn.Do(ctx, func(ch *amqp091.Channel) error {
		for {
			d, ok, err := ch.Get(reader, true)
			if err != nil || !ok {
				return err
			}
			if d.RoutingKey != comandes.Topic {
				return fmt.Errorf("routing key %q, want the topic name", d.RoutingKey)
			}
			got[d.MessageId] = true
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if !got[id] {
			t.Errorf("event %s of comandes' outbox never reached the queue bound with %q", id, comandes.Topic)
		}
	}
	if len(ids) < 2*orders || len(got) != len(ids) {
		t.Errorf("the foreign reader got %d distinct events, comandes' outbox holds %d (want ≥ %d)", len(got), len(ids), 2*orders)
	}
	dlq := contract.DLQName(queueOf(t, sys, inventari.ConsumerDecrement))
	if n := amqptest.QueueLen(t, conn, dlq); n != 1 {
		t.Errorf("%s holds %d messages, want 1", dlq, n)
	}
	for _, name := range system.ConsumerNames {
		if name == inventari.ConsumerDecrement {
			continue
		}
		if n := amqptest.QueueLen(t, conn, contract.DLQName(queueOf(t, sys, name))); n != 0 {
			t.Errorf("%s's DLQ holds %d messages, want 0", name, n)
		}
	}
}

// foreignReader declares on the broker at amqpURL, before the system
// starts, a queue bound to the events' exchange with the bare topic name, as
// a program of another language reads the events (CONTRACT.md).
func foreignReader(t *testing.T, amqpURL, exchange, topic string) string {
	t.Helper()
	q := amqptest.Name("km0.test.lector")
	conn := amqptest.DialURL(t, amqpURL)
	topo := amqp.Topology{Exchanges: []amqp.Exchange{{Name: exchange, Kind: amqp091.ExchangeTopic, Durable: true}},
		Queues: []amqp.Queue{{Name: q, Durable: true}}, Bindings: []amqp.Binding{{Queue: q, Exchange: exchange, Key: topic}}}
	if err := conn.Declare(context.Background(), topo); err != nil {
		t.Fatal(err)
	}
	return q
}

// queueOf finds the logical queue of consumidor name among the system's.
func queueOf(t *testing.T, sys *system.System, name string) string {
	t.Helper()
	for _, q := range sys.EventQueues() {
		if strings.HasSuffix(q, "."+name+contract.DLQSuffix) {
			return strings.TrimSuffix(q, contract.DLQSuffix)
		}
	}
	t.Fatalf("no queue of %s in %v", name, sys.EventQueues())
	return ""
}

// Bad choices of broker are refused with an error naming them, before
// anything starts.
func TestEventsConfigIsChecked(t *testing.T) {
	for _, tc := range []struct {
		cfg  system.Config
		want string
	}{
		{system.Config{Events: "nats", Brokers: []string{"x"}}, `Config.Events "nats"`},
		{system.Config{EventsByTopic: map[string]string{"comandes": "rabbitmq"}, Brokers: []string{"x"}}, `unknown topic "comandes"`},
		{system.Config{EventsByTopic: map[string]string{"comandes.esdeveniments": "sqs"}, Brokers: []string{"x"}}, `broker "sqs"`},
		{system.Config{Events: system.EventsRabbitMQ}, "need Config.AMQPURL"},
		{system.Config{Events: system.EventsRabbitMQ, EventsByTopic: map[string]string{"inventari.esdeveniments": "kafka"}, AMQPURL: "amqp://x"}, "Config.Brokers is required"},
		{system.Config{}, "Config.Brokers is required"},
		{system.Config{Events: system.EventsRabbitMQ, AMQPURL: "amqp://x", EventsExchange: "amq.topic"}, "EventsExchange"},
		{system.Config{Events: system.EventsRabbitMQ, AMQPURL: "amqp://x", EventsQueuePrefix: "a b"}, "EventsQueuePrefix"},
	} {
		if _, err := system.Start(context.Background(), tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error with %q", tc.cfg, err, tc.want)
		}
	}
	for in, want := range map[string]string{
		"":                                      " map[]",
		"rabbitmq":                              "rabbitmq map[]",
		"kafka,comandes.esdeveniments=rabbitmq": "kafka map[comandes.esdeveniments:rabbitmq]",
		" comandes.esdeveniments = rabbitmq ":   " map[comandes.esdeveniments:rabbitmq]",
	} {
		b, m, err := system.ParseEvents(in)
		if got := fmt.Sprintf("%s %v", b, m); err != nil || got != want {
			t.Errorf("ParseEvents(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"pigeon", "kafka,rabbitmq", "x.esdeveniments=kafka", "comandes.esdeveniments=kafka,comandes.esdeveniments=rabbitmq"} {
		if _, _, err := system.ParseEvents(in); err == nil {
			t.Errorf("ParseEvents(%q) accepted", in)
		}
	}
}
