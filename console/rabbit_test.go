package console_test

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/console"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/amqpdlq"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// On RabbitMQ the console does what it does on Kafka: the group of a
// queue's DLQ, a dry run, a replay job back to the work queue, and a purge
// without record deletion (the letters left the broker when indexed).
func TestRabbitMQReplayAndPurge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := amqptest.Dial(t)
	s := pgtest.NewSchema(t)
	if _, err := migrate.Up(ctx, s.Pool, s.Names(), dlq.Migrations); err != nil {
		t.Fatal(err)
	}
	q := amqptest.Name("t.console")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{q, contract.DLQName(q)} })
	if err := conn.Declare(ctx, amqp.WorkQueueTopology("", q, q, false)); err != nil {
		t.Fatal(err)
	}
	dlx, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: amqp.DLXDefault, ExchangeKind: amqp091.ExchangeDirect})
	if err != nil {
		t.Fatal(err)
	}
	defer dlx.Close() //nolint:errcheck
	now := time.Now()
	for i := 0; i < 4; i++ {
		id := uuid.NewString()
		e := &envelope.Envelope{ID: id, Type: "comanda.creada", Version: 1, TimeMS: now.UnixMilli(), Origin: "comandes",
			Data: json.RawMessage(`{"id":"P-1","client":"` + customer + `"}`)}
		val, err := e.Encode()
		if err != nil {
			t.Fatal(err)
		}
		m := &transport.Message{Topic: q, Key: []byte("P-1"), Value: val, Headers: []transport.Header{
			{Key: contract.HeaderEventID, Value: id}, {Key: contract.HeaderType, Value: "comanda.creada"},
			{Key: contract.HeaderAttempts, Value: "3"}, {Key: contract.HeaderReason, Value: "transitori esgotat: mapes: 503"},
			{Key: amqp.HeaderOriginQueue, Value: q}, {Key: contract.HeaderDeadAt, Value: contract.FormatTime(now)}}}
		if err := dlx.Publish(ctx, []*transport.Message{m}); err != nil {
			t.Fatal(err)
		}
	}
	backend, err := amqpdlq.New(amqpdlq.Config{Conn: conn, Queues: []string{q}})
	if err != nil {
		t.Fatal(err)
	}
	defer backend.Close() //nolint:errcheck
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: dlq.NewStore(s.Pool, s.Name), Backend: backend, Logger: quietLog})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "4 letters indexed", func() bool {
		_, _ = svc.Sync(ctx)
		ls, err := svc.List(ctx, dlq.Filter{Limit: 1})
		return err == nil && len(ls.Groups) == 1 && ls.Groups[0].Count == 4
	})

	con, err := console.New(console.Config{Source: svc, Broker: "RabbitMQ", Token: token, Logger: quietLog})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(con.Handler())
	defer func() { srv.Close(); con.Close() }()
	br := (&bundle{srv: srv}).browser(t)
	csrf := br.login(token)
	_, body := br.get("/")
	if !strings.Contains(body, `<td class="num count">4</td>`) || !strings.Contains(body, "<th>queue</th>") {
		t.Fatalf("overview on RabbitMQ:\n%s", body)
	}
	dlqName := contract.DLQName(q)
	class := "transitori esgotat: mapes"
	ls, _ := svc.List(ctx, dlq.Filter{Limit: 10})
	// Purge one, with the confirmation page offering no record deletion.
	one := url.Values{"csrf": {csrf}, "abast": {"seleccio"}, "id": {ls.Letters[0].ID}}
	_, body = br.post("/purgar/confirmar", one)
	one.Set("pla", planOf(t, body))
	if strings.Contains(body, "delete_records") || !strings.Contains(body, `<b id="purge-count">1</b>`) {
		t.Fatalf("purge confirmation on RabbitMQ:\n%s", body)
	}
	one.Set("confirmo", "1")
	one.Set("delete_records", "1") // ignored on RabbitMQ
	if _, body = br.post("/purgar", one); !strings.Contains(body, `<b id="purged">1</b>`) {
		t.Fatalf("purge on RabbitMQ:\n%s", body)
	}
	sel := url.Values{"csrf": {csrf}, "abast": {"grup"}, "topic": {dlqName}, "classe": {class}}
	_, body = br.post("/reproduir/previsualitzar", sel)
	sel.Set("pla", planOf(t, body))
	if !strings.Contains(body, `<b id="would">3</b>`) {
		t.Fatalf("dry run on RabbitMQ:\n%s", body)
	}
	sel.Set("confirmo", "1")
	resp, _ := br.post("/reproduir", sel)
	loc := strings.Replace(resp.Header.Get("Location"), "/feina?", "/feina.json?", 1)
	var st console.JobStatus
	testkit.Eventually(t, 30*time.Second, "the replay job", func() bool {
		_, body := br.get(loc)
		_ = json.Unmarshal([]byte(body), &st)
		return st.State != "" && st.State != "running"
	})

	if st.State != "done" || st.Republished != 3 || st.Failed != 0 {
		t.Fatalf("job: %+v", st)
	}
	testkit.Eventually(t, 10*time.Second, "3 messages back in the work queue", func() bool { return amqptest.QueueLen(t, conn, q) == 3 })
	var pending int
	if err := s.Pool.QueryRow(ctx, "SELECT count(*) FROM cartes_mortes WHERE estat = 'pendent'").Scan(&pending); err != nil || pending != 0 {
		t.Fatalf("pending after the replay: %d %v", pending, err)
	}
}
