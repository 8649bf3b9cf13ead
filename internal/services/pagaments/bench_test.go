package pagaments_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/transport/amqp"
)

// BenchmarkAuthorizeOverRabbitMQ is the authorisation server as the system
// runs it (amqprr server, 64 workers, Authorize on PostgreSQL, a pool of 4)
// with 1 and 64 callers, each authorising a new order. Compare it with
// BenchmarkPlainServerOverRabbitMQ in the same run. A direction check: the
// figures users see come from `km0 bench system`.
func BenchmarkAuthorizeOverRabbitMQ(b *testing.B) {
	for _, callers := range []int{1, 64} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			pool, _ := svctest.DB(b, migrate.Outbox, migrate.Inbox, pagaments.Migrations)
			s, err := pagaments.New(pagaments.Config{Pool: pool})
			if err != nil {
				b.Fatal(err)
			}
			conn := amqptest.Dial(b)
			queue := amqptest.Name("b.pagaments")
			srv, err := amqprr.NewServer(context.Background(), amqprr.ServerConfig{Conn: conn, Queue: queue, Workers: 64, Prefetch: 128, Logger: quiet,
				Handler: func(ctx context.Context, r *requestreply.Request) ([]byte, error) { return s.Authorize(ctx, r.Body) }})
			if err != nil {
				b.Fatal(err)
			}
			amqptest.DeleteQueuesAtCleanup(b, srv.Queues)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); _ = srv.Run(ctx) }()
			b.Cleanup(func() { cancel(); <-done })
			drive(b, conn, queue, callers)
		})
	}
}

// BenchmarkPlainServerOverRabbitMQ is the peer: a plain amqp091-go server
// (64 goroutines on one channel, prefetch 128) that stores each response in
// PostgreSQL (INSERT … ON CONFLICT DO NOTHING, autocommit, a pool of 16),
// publishes the reply and acks, driven by the same callers.
func BenchmarkPlainServerOverRabbitMQ(b *testing.B) {
	for _, callers := range []int{1, 64} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			_, u := svctest.DB(b)
			pool := pgtest.NewPool(b, u, 16)
			ctx, cancel := context.WithCancel(context.Background())
			if _, err := pool.Exec(ctx, `CREATE TABLE respostes (id TEXT PRIMARY KEY, resposta BYTEA NOT NULL)`); err != nil {
				b.Fatal(err)
			}
			raw, err := amqp091.Dial(amqptest.URL())
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = raw.Close() })
			ch, err := raw.Channel()
			if err != nil {
				b.Fatal(err)
			}
			queue := amqptest.Name("b.pla")
			if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
				b.Fatal(err)
			}
			amqptest.DeleteQueuesAtCleanup(b, func() []string { return []string{queue} })
			_ = ch.Qos(128, 0, false)
			deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
			if err != nil {
				b.Fatal(err)
			}
			var wg sync.WaitGroup
			for range 64 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for d := range deliveries {
						resp := []byte(`{"aprovada":true}`)
						if _, err := pool.Exec(ctx, `INSERT INTO respostes (id, resposta) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING`, d.MessageId, resp); err != nil {
							_ = d.Nack(false, true)
							continue
						}
						_ = ch.PublishWithContext(ctx, "", d.ReplyTo, false, false, amqp091.Publishing{CorrelationId: d.CorrelationId,
							Headers: amqp091.Table{requestreply.HeaderResult: requestreply.ResultOK}, Body: resp})
						_ = d.Ack(false)
					}
				}()
			}
			b.Cleanup(func() { cancel(); _ = ch.Close(); wg.Wait() })
			conn := amqptest.Dial(b)
			drive(b, conn, queue, callers)
		})
	}
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// drive sends b.N authorisations of new orders from callers goroutines and
// reports req/s, p50 and p99.
func drive(b *testing.B, conn *amqp.Conn, queue string, callers int) {
	cl, err := amqprr.NewClient(context.Background(), amqprr.ClientConfig{Conn: conn, Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cl.Close() })
	var n atomic.Int64
	lat := make([][]time.Duration, callers)
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for g := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := n.Add(1)
				if i > int64(b.N) {
					return
				}
				body := fmt.Sprintf(`{"comanda_id":"B-%d","import_centims":1000}`, i)
				t0 := time.Now()
				if _, err := cl.Request(context.Background(), queue, fmt.Sprintf("autoritzacio-B-%d", i), []byte(body)); err != nil {
					b.Error(err)
					return
				}
				lat[g] = append(lat[g], time.Since(t0))
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	b.StopTimer()
	all := slices.Concat(lat...)
	slices.Sort(all)
	if len(all) > 0 {
		b.ReportMetric(float64(len(all))/el.Seconds(), "req/s")
		b.ReportMetric(float64(all[len(all)/2].Microseconds())/1000, "p50_ms")
		b.ReportMetric(float64(all[len(all)*99/100].Microseconds())/1000, "p99_ms")
	}
}
