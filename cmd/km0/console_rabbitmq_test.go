package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
)

// km0 up --console with the events on RabbitMQ, and with them on both
// brokers (the orders on RabbitMQ, the rest on an embedded Kafka): the
// console indexes the system's RabbitMQ dead letters. An order for more
// cheese than there is reaches inventari over RabbitMQ and is dead-lettered
// there (a native nack to its <group>.dlq); over HTTP, the console's
// overview counts it under that queue and its letters endpoint lists it,
// the order's comanda.creada with the order as key. Each km0 up runs on a
// vhost of its own (amqptest.VHost), so the fixed names it declares
// (pagaments.autoritzacions, inventari.reserves, km0.dlx) are not another
// test's.
func TestUpConsoleListsTheSystemsRabbitMQDeadLetters(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		events []string
		column string // the overview's heading of the DLQ column
	}{
		{"RabbitMQ", []string{"--events", "rabbitmq"}, "<th>queue</th>"},
		{"Mixed", []string{"--events", "kafka,comandes.esdeveniments=rabbitmq", "--embedded-kafka"}, "<th>topic or queue</th>"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			amqpURL := amqptest.VHost(t) // deleted, with all in it, after km0 up stops
			name := amqptest.Name("km0.test.console")
			exchange, prefix := name+".esdeveniments", name+"."
			suffix := "t" + strings.ReplaceAll(name[len("km0.test.console."):], ".", "")
			t.Cleanup(func() { // after the process stopped (cleanups run last first)
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				for _, s := range append([]string{"dlq"}, system.Services...) {
					if err := svc.DropDatabase(ctx, pgtest.URL(), svc.DatabaseName(s, suffix)); err != nil {
						t.Errorf("cleanup: %v", err)
					}
				}
			})
			api, console := freeAddr(t), freeAddr(t)
			args := append([]string{"up", "--database-url", pgtest.URL(), "--database-suffix", suffix, "--amqp-url", amqpURL,
				"--events-exchange", exchange, "--events-queue-prefix", prefix, "--http", "comandes=" + api, "--console", console}, tc.events...)
			const adminToken = "t0k3n-of-the-rabbitmq-console-test"
			up := startKm0(t, []string{dlqcli.AdminTokenEnv + "=" + adminToken}, args...)
			up.waitRunning(t, 90*time.Second)
			defer func() { // a clean stop: the console and the system close their connections
				_ = up.cmd.Process.Signal(syscall.SIGTERM)
				select {
				case <-up.exited:
				case <-time.After(30 * time.Second):
					t.Errorf("km0 up did not stop within 30 s of SIGTERM\n%s", up.log())
				}
			}()

			order := "P-2026-000666"
			body := fmt.Sprintf(`{"id":%q,"client":"anna","mercat":"girona","linies":[{"producte":"formatge-curat","quantitat":6,"preu_centims":900}],`+
				`"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`, order)
			req, _ := http.NewRequest(http.MethodPost, "http://"+api+"/comandes", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", "k-cheese")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusCreated {
				t.Fatalf("order: %d", resp.StatusCode)
			}

			dlqName := contract.DLQName(prefix + "inventari.descompte_estoc")
			get := func(path string) (int, string) {
				req, _ := http.NewRequest(http.MethodGet, "http://"+console+path, nil)
				if strings.HasPrefix(path, "/dlq/") {
					req.Header.Set("Authorization", "Bearer "+adminToken)
				}
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return 0, err.Error()
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, string(b)
			}
			var page string
			testkit.Eventually(t, time.Minute, "the console's overview to count the dead letter", func() bool {
				code, b := get("/")
				page = b
				return code == http.StatusOK && strings.Contains(b, `data-topic="`+dlqName+`"`) && strings.Contains(b, `<td class="num count">1</td>`)
			})

			if !strings.Contains(page, tc.column) {
				t.Errorf("the overview's DLQ column is not headed %s:\n%s", tc.column, page)
			}
			code, b := get("/dlq/letters?topic=" + dlqName)
			var ls struct {
				Letters []struct {
					Topic string `json:"topic"`
					Type  string `json:"tipus"`
					Key   string `json:"clau"`
					Class string `json:"classe_motiu"`
				} `json:"cartes"`
			}
			if code != http.StatusOK || json.Unmarshal([]byte(b), &ls) != nil {
				t.Fatalf("GET /dlq/letters: %d\n%s", code, b)
			}
			if len(ls.Letters) != 1 || ls.Letters[0].Type != "comanda.creada" || ls.Letters[0].Key != order ||
				!strings.HasPrefix(ls.Letters[0].Class, "permanent") {
				t.Fatalf("letters of %s: %+v", dlqName, ls.Letters)
			}
		})
	}
}
