package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

func init() { registerBench("rpc", benchRPC) }

// benchRPC measures request/reply round trips: an in-process server that
// answers at once, and 1 and 64 concurrent callers, over RabbitMQ and (with
// --kafka) over an embedded Kafka broker. One JSON line per run.
func benchRPC(ctx context.Context, args []string) error {
	fs := cli.NewFlags("bench rpc", "request/reply round trips (p50, p99, requests/s) over RabbitMQ and the embedded Kafka")
	amqpURL := cli.SecretString(fs, "amqp-url", cmpOr(os.Getenv("KM0_AMQP_URL"), amqp.URLDefault), "RabbitMQ URL (default $KM0_AMQP_URL or the local guest broker)")
	n := fs.Int("n", 20000, "requests per run")
	callersFlag := fs.String("callers", "1,64", "comma-separated numbers of concurrent callers")
	withKafka := fs.Bool("kafka", true, "also measure over an embedded Kafka broker (kfake)")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *n <= 0 {
		return errors.New("--n must be positive")
	}
	var callers []int
	for _, s := range strings.Split(*callersFlag, ",") {
		c, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || c <= 0 {
			return fmt.Errorf("--callers: %q is not a positive number", s)
		}
		callers = append(callers, c)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	echo := func(_ context.Context, req *requestreply.Request) ([]byte, error) { return req.Body, nil }

	if err := benchRPCAMQP(ctx, *amqpURL, *n, callers, quiet, echo); err != nil {
		return err
	}
	if *withKafka {
		return benchRPCKafka(ctx, *n, callers, quiet, echo)
	}
	return nil
}

func benchRPCAMQP(ctx context.Context, url string, n int, callers []int, log *slog.Logger, h requestreply.Handler) error {
	conn, err := amqp.Dial(ctx, amqp.Config{URL: url, Name: "km0 bench rpc", Logger: log})
	if err != nil {
		return err
	}
	defer conn.Close()
	queue := "km0.bench.rpc." + randHex(4)
	srv, err := amqprr.NewServer(ctx, amqprr.ServerConfig{Conn: conn, Queue: queue, Handler: h, Workers: 64, Prefetch: 256, Logger: log})
	if err != nil {
		return err
	}
	defer func() {
		_ = conn.Do(context.Background(), func(ch *amqp091.Channel) error {
			for _, q := range srv.Queues() {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
			return nil
		})
	}()
	stop := runInBackground(ctx, srv.Run)
	defer stop()
	// The client has its own connection, as it would in its own process.
	cconn, err := amqp.Dial(ctx, amqp.Config{URL: url, Name: "km0 bench rpc client", Logger: log})
	if err != nil {
		return err
	}
	defer cconn.Close()
	cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: cconn, Logger: log})
	if err != nil {
		return err
	}
	defer cl.Close()
	return measureRPC(ctx, "amqp", cl, queue, n, callers)
}

func benchRPCKafka(ctx context.Context, n int, callers []int, log *slog.Logger, h requestreply.Handler) error {
	b, err := kafkaembed.Start(kafkaembed.Config{})
	if err != nil {
		return err
	}
	defer b.Close()
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: b.Addrs(), Handler: h, Workers: 64, Logger: log})
	if err != nil {
		return err
	}
	stop := runInBackground(ctx, srv.Run)
	defer stop()
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs(), Logger: log})
	if err != nil {
		return err
	}
	defer cl.Close()
	return measureRPC(ctx, "kafka-embedded", cl, kafkarr.TopicDefault, n, callers)
}

// runInBackground runs fn until the returned stop is called.
func runInBackground(ctx context.Context, fn func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = fn(ctx)
	}()
	return func() { cancel(); <-done }
}

// measureRPC warms up, then for each caller count sends n requests split
// over that many goroutines and emits the round-trip percentiles and rate.
func measureRPC(ctx context.Context, transport string, r requestreply.Requester, service string, n int, callers []int) error {
	body := []byte(`{"comanda_id":"P-2026-000123","import_centims":4250}`)
	for i := range 200 {
		if _, err := r.Request(ctx, service, "escalfament-"+strconv.Itoa(i), body); err != nil {
			return fmt.Errorf("%s warm-up: %w", transport, err)
		}
	}
	for _, c := range callers {
		lat := make([][]time.Duration, c)
		errs := make([]int, c)
		var wg sync.WaitGroup
		start := time.Now()
		for g := range c {
			count := n / c
			if g < n%c {
				count++
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				lat[g] = make([]time.Duration, 0, count)
				for i := range count {
					t0 := time.Now()
					if _, err := r.Request(ctx, service, fmt.Sprintf("b-%d-%d", g, i), body); err != nil {
						errs[g]++
						continue
					}
					lat[g] = append(lat[g], time.Since(t0))
				}
			}()
		}
		wg.Wait()
		elapsed := time.Since(start)
		all := slices.Concat(lat...)
		slices.Sort(all)
		failed := 0
		for _, e := range errs {
			failed += e
		}
		if len(all) == 0 {
			return fmt.Errorf("%s: every request failed", transport)
		}
		emit(map[string]any{
			"bench": "rpc", "transport": transport, "callers": c, "requests": n, "errors": failed,
			"p50_ms":         round2(ms(all[len(all)/2])),
			"p99_ms":         round2(ms(all[len(all)*99/100])),
			"requests_per_s": round2(float64(len(all)) / elapsed.Seconds()),
		})
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
