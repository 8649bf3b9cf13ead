package system_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// Kafka unavailable for a while, with inventari reading comanda.creada from
// RabbitMQ (EventsByTopic) or from Kafka, and publishing estoc.actualitzat
// to Kafka either way (CONTRACT.md guarantee 7; the lesson's exercise on the
// outbox of inventari, case (c)). Over RabbitMQ inventari keeps taking stock
// for every order while Kafka is down, and its estoc.actualitzat events wait
// in its outbox (publicat_en IS NULL) with cataleg seeing none of them; over
// Kafka inventari takes nothing. In both cases, once Kafka is back, every
// event goes out, in order per product (each product's despres strictly
// falls along its partition), cataleg ends equal to inventari, and no order
// is decremented twice.
func TestKafkaDownInventariOnRabbitMQKeepsWorkingAndNothingIsLost(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		orders string // broker of comandes.esdeveniments
	}{{"inventari reads RabbitMQ", system.EventsRabbitMQ}, {"inventari reads Kafka", system.EventsKafka}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var cleanup func(*system.System)
			sys, b := startWith(t, []string{comandes.Name, inventari.Name, cataleg.Name}, func(c *system.Config) {
				brokers := c.Brokers
				cleanup = rabbitEvents(t, c) // RabbitMQ carries request/reply, and the orders when chosen
				c.Brokers, c.Events = brokers, system.EventsKafka
				c.EventsByTopic = map[string]string{comandes.Topic: tc.orders}
				c.Backoff = 50 * time.Millisecond
			})
			cleanup(sys)
			ctx := context.Background()
			count := func(service, q string) int {
				var n int
				if err := sys.Pool(service).QueryRow(ctx, q).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			pendingStock := func() int {
				return count(inventari.Name, `SELECT count(*) FROM outbox WHERE publicat_en IS NULL AND tipus = 'estoc.actualitzat'`)
			}
			const orders = 30
			up := b.Unreachable()
			for i := range orders {
				body := fmt.Sprintf(`{"id":"P-2026-%06d","client":"c","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":100},`+
					`{"producte":"tomaquet-rosa","quantitat":2,"preu_centims":100}],"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`, i)
				if r := postOrder(t, sys.Addrs()[comandes.Name], fmt.Sprintf("k-%d", i), body); r.status != http.StatusCreated {
					t.Fatalf("order %d while Kafka is down: %d %s", i, r.status, r.body)
				}
			}
			stock := func() map[string]int {
				s, err := sys.Inventari.Stock(ctx)
				if err != nil {
					t.Fatal(err)
				}
				return s
			}
			if tc.orders == system.EventsRabbitMQ {
				// Inventari keeps working: every order taken from stock, its
				// events waiting in the outbox for Kafka.
				testkit.Eventuallyf(t, 30*time.Second, fmt.Sprintf("Kafka down, orders on RabbitMQ: every order taken from stock and %d estoc.actualitzat pending", 2*orders), func() (bool, string) {
					s, pending := stock(), pendingStock()
					return s["carbasso"] == 80-orders && s["tomaquet-rosa"] == 120-2*orders && pending == 2*orders, fmt.Sprintf("stock %v, %d pending", s, pending)
				})
			} else {
				// Inventari stops: its orders wait in comandes' outbox.
				deadline := time.Now().Add(2 * time.Second)
				for time.Now().Before(deadline) {
					if s := stock(); s["carbasso"] != 80 || s["tomaquet-rosa"] != 120 {
						t.Fatalf("Kafka down, orders on Kafka: stock moved to %v", s)
					}
					time.Sleep(50 * time.Millisecond)
				}
				if n := count(comandes.Name, `SELECT count(*) FROM outbox WHERE publicat_en IS NULL`); n != orders {
					t.Fatalf("%d comanda.creada pending in comandes' outbox, want %d", n, orders)
				}
			}
			if flags, err := sys.Cataleg.Flags(ctx); err != nil || len(flags) != 0 {
				t.Fatalf("cataleg flags %v (%v) while Kafka is down, want none", flags, err)
			}
			up()
			testkit.Eventuallyf(t, 60*time.Second, "Kafka back: stock, cataleg and the outbox settled", func() (bool, string) {
				flags, err := sys.Cataleg.Flags(ctx)
				if err != nil {
					t.Fatal(err)
				}
				s, pending := stock(), pendingStock()
				done := pending == 0 && len(flags) == 2 && s["carbasso"] == 80-orders && s["tomaquet-rosa"] == 120-2*orders
				for _, f := range flags {
					done = done && f.Units == s[f.Product]
				}
				return done, fmt.Sprintf("stock %v, cataleg %v, %d estoc.actualitzat pending", s, flags, pending)
			})
			if n := count(inventari.Name, `SELECT count(*) FROM (SELECT 1 FROM outbox WHERE tipus = 'estoc.actualitzat'
				GROUP BY carrega->>'comanda_id', carrega->>'producte' HAVING count(*) > 1) d`); n != 0 {
				t.Errorf("%d (order, product) pairs decremented twice", n)
			}
			checkStockOrderOnKafka(t, b, 2*orders)
		})
	}
}

// checkStockOrderOnKafka reads inventari.esdeveniments and checks that it
// holds want events and that each product's despres strictly falls along
// its partition: the outbox went out in commit order per product.
func checkStockOrderOnKafka(t *testing.T, b *kafkaembed.Broker, want int) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.Addrs()...), kgo.ConsumeTopics(inventari.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	last := map[string]int{}
	ids := map[string]bool{}
	for len(ids) < want {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("%d distinct events on %s after 30 s, want %d", len(ids), inventari.Topic, want)
		}
		fs.EachRecord(func(r *kgo.Record) {
			var env struct {
				ID   string `json:"id_esdeveniment"`
				Data struct {
					Product string `json:"producte"`
					After   int    `json:"despres"`
				} `json:"dades"`
			}
			if err := json.Unmarshal(r.Value, &env); err != nil {
				t.Fatal(err)
			}
			if ids[env.ID] {
				return // a republication (the relay may send a batch again)
			}
			ids[env.ID] = true
			if prev, ok := last[env.Data.Product]; ok && env.Data.After >= prev {
				t.Errorf("%s: despres %d after %d: out of order", env.Data.Product, env.Data.After, prev)
			}
			last[env.Data.Product] = env.Data.After
		})
	}
}
