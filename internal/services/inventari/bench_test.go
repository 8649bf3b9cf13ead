package inventari_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// BenchmarkConsumeOrdersHotRows is a micro-benchmark (broker in process, no
// relay): the consumer of comanda.creada as services/system wires it
// (Concurrency 2, BatchSize inventari.ConsumerBatchSize) on 20,000 orders of
// one or two lines over the contract's five products, 6 partitions. With
// cheese=out formatge-curat is not restocked, so about a quarter of the
// orders are refused and dead-lettered. It reports orders/s (applied +
// dead-lettered) and the deadlocks PostgreSQL counted in the database.
//
//	go test -run '^$' -bench ConsumeOrdersHotRows -benchtime 1x ./services/inventari/
func BenchmarkConsumeOrdersHotRows(b *testing.B) {
	for _, cheese := range []string{"restocked", "out"} {
		b.Run("cheese="+cheese, func(b *testing.B) {
			for range b.N {
				benchConsumeOrders(b, 20_000, cheese == "out")
			}
		})
	}
}

func benchConsumeOrders(b *testing.B, n int, cheeseOut bool) {
	b.StopTimer()
	w := newWorld(b, 5) // services/system's MaxConnsDefault
	ctx := context.Background()
	products := []string{"tomaquet-rosa", "carbasso", "formatge-curat", "formatge-fresc", "vi-crianca"}
	for _, p := range products {
		if p == "formatge-curat" && cheeseOut {
			continue
		}
		if err := w.s.Restock(ctx, p, 1_000_000); err != nil {
			b.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	recs := make([]*kgo.Record, n)
	for i := range recs {
		var lines []inventari.Line
		for range 1 + rng.IntN(2) {
			lines = append(lines, inventari.Line{Product: products[rng.IntN(len(products))], Quantity: 1 + rng.IntN(3)})
		}
		id := fmt.Sprintf("P-2026-%06d", i)
		recs[i], _ = orderRecord(b, id, id, lines...)
	}
	if err := w.pub.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		b.Fatal(err)
	}
	cfg := w.config()
	cfg.Concurrency = 2
	cfg.BatchSize = inventari.ConsumerBatchSize
	c, err := consumer.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	b.StartTimer()
	start := time.Now()
	go func() { errc <- c.Run(runCtx) }()
	for st := c.Stats(); st.Processed+st.DeadLettered < int64(n); st = c.Stats() {
		if time.Since(start) > 5*time.Minute {
			b.Fatalf("stats %+v after 5 minutes", st)
		}
		time.Sleep(2 * time.Millisecond)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	cancel()
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	st := c.Stats()
	w.pool.Close()
	b.ReportMetric(float64(n)/elapsed.Seconds(), "orders/s")
	b.ReportMetric(float64(st.DeadLettered), "dead_lettered")
	b.ReportMetric(float64(w.deadlocks(true)), "deadlocks")
	b.ReportMetric(float64(st.Conflicts), "conflicts")
}

// BenchmarkServeInventari is BenchmarkConsumeOrdersHotRows through
// system.Start, which is what `km0 serve inventari` runs: the schema-checking
// decoder and outbox, and the relay publishing estoc.actualitzat in the same
// process. Still a micro-benchmark: the broker is in this process.
//
//	go test -run '^$' -bench ServeInventari -benchtime 1x -cpuprofile cpu.out ./services/inventari/
func BenchmarkServeInventari(b *testing.B) {
	for range b.N {
		benchServe(b, 50_000)
	}
}

func benchServe(b *testing.B, n int) {
	b.StopTimer()
	ctx := context.Background()
	suffix := fmt.Sprintf("bench_%d", time.Now().UnixNano())
	admin, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		b.Fatal(err)
	}
	defer admin.Close(ctx)
	defer admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{"km0_inventari_" + suffix}.Sanitize()+" WITH (FORCE)") //nolint:errcheck
	kb := kafkatest.NewWith(b, kafkaembed.Config{Topics: system.DomainTopics()})
	sys, err := system.Start(ctx, system.Config{DatabaseURL: pgtest.URL(), DatabaseSuffix: suffix, Brokers: kb.Addrs(),
		Services: []string{inventari.Name}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer sys.Close()
	products := []string{"tomaquet-rosa", "carbasso", "formatge-curat", "formatge-fresc", "vi-crianca"}
	for _, p := range products {
		if err := sys.Inventari.Restock(ctx, p, 1_000_000); err != nil {
			b.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	recs := make([]*kgo.Record, n)
	for i := range recs {
		var lines []inventari.Line
		for range 1 + rng.IntN(2) {
			lines = append(lines, inventari.Line{Product: products[rng.IntN(len(products))], Quantity: 1 + rng.IntN(3)})
		}
		id := fmt.Sprintf("P-2026-%06d", i)
		recs[i], _ = orderRecord(b, id, id, lines...)
	}
	pub := kafkatest.Client(b, kb)
	b.StartTimer()
	start := time.Now()
	if err := pub.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		b.Fatal(err)
	}
	for {
		st := sys.ConsumerStats()[inventari.ConsumerDecrement]
		if st.Processed+st.DeadLettered >= int64(n) {
			break
		}
		if time.Since(start) > 5*time.Minute {
			b.Fatalf("stats %+v after 5 minutes", st)
		}
		time.Sleep(2 * time.Millisecond)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	st := sys.ConsumerStats()[inventari.ConsumerDecrement]
	if st.Processed != int64(n) {
		b.Fatalf("stats %+v, want every order applied", st)
	}
	b.ReportMetric(float64(n)/elapsed.Seconds(), "orders/s")
}
