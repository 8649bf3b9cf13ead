package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/amqp"
)

// `km0 serve comandes` and `km0 serve inventari`, separate processes with
// --events rabbitmq and no Kafka at all: orders taken while inventari has
// never run are not lost (comandes' process declared every consumer's
// queues before its relay published), and once inventari starts it takes
// them from stock, and its estoc.actualitzat wait in cataleg's queues,
// though cataleg never ran either. The processes run on a vhost of the
// test's own (amqptest.VHost): the fixed names they declare
// (pagaments.autoritzacions, km0.dlx) are not another test's.
func TestServeProcessesCarryTheirEventsOverRabbitMQ(t *testing.T) {
	t.Parallel()
	amqpURL := amqptest.VHost(t) // deleted, with all in it, after the processes stop
	name := amqptest.Name("km0.test.serve")
	exchange, prefix := name+".esdeveniments", name+"."
	comandesDB, inventariDB := pgtest.NewDatabase(t), pgtest.NewDatabase(t)
	env := []string{serviceDatabaseEnv("comandes") + "=" + comandesDB, serviceDatabaseEnv("inventari") + "=" + inventariDB}
	addr := freeAddr(t)
	flags := []string{"--events", "rabbitmq", "--amqp-url", amqpURL, "--events-exchange", exchange, "--events-queue-prefix", prefix}
	comandes := startKm0(t, env, append([]string{"serve", "comandes", "--http", "comandes=" + addr}, flags...)...)
	comandes.waitRunning(t, 60*time.Second)
	const orders = 5
	for i := range orders {
		body := fmt.Sprintf(`{"id":"P-2026-%06d","client":"anna","mercat":"vic","linies":[{"producte":"carbasso","quantitat":2,"preu_centims":300}]}`, i)
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/comandes", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", fmt.Sprint("k", i))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("order %d: %d", i, resp.StatusCode)
		}
	}
	cp := pgtest.NewPool(t, comandesDB, 1)
	testkit.Eventually(t, time.Minute, "comandes' outbox published", func() bool {
		var n int
		return cp.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE publicat_en IS NULL`).Scan(&n) == nil && n == 0
	})

	inventari := startKm0(t, env, append([]string{"serve", "inventari"}, flags...)...)
	inventari.waitRunning(t, 60*time.Second)
	ip := pgtest.NewPool(t, inventariDB, 1)
	testkit.Eventually(t, time.Minute, "inventari took the orders from stock", func() bool {
		var units, published int
		err := ip.QueryRow(context.Background(), `SELECT (SELECT unitats FROM estoc WHERE producte = 'carbasso'),
			(SELECT count(*) FROM outbox WHERE tipus = 'estoc.actualitzat' AND publicat_en IS NOT NULL)`).Scan(&units, &published)
		return err == nil && units == 80-2*orders && published == orders
	})

	conn := amqptest.DialURL(t, amqpURL)
	testkit.Eventually(t, time.Minute, "cataleg's queues hold the stock events", func() bool {
		n := 0
		for i := range system.EventShards {
			n += amqptest.QueueLen(t, conn, amqp.ShardQueueName(prefix+"cataleg.estoc_baix", i))
		}
		return n == orders
	})
}
