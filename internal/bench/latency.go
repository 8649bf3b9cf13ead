package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

func benchLatency(ctx context.Context, args []string) error {
	fs := cli.NewFlags("bench latency", "commit → consumer commit latency at a fixed rate, each event in its own transaction")
	dbURL := cli.SecretString(fs, "database-url", benchDatabaseURL(), "PostgreSQL URL (default $KM0_DATABASE_URL, else the local server); a throwaway schema is used and dropped")
	brokers := benchBrokersFlag(fs)
	rate := fs.Int("rate", 1000, "events per second")
	seconds := fs.Float64("seconds", 5, "how long to write")
	workers := fs.Int("workers", 0, "km0 relay: claim workers; 0 (the relay's default) adapts to the backlog")
	baseline := fs.Bool("baseline", false, "also measure the straight Go port of the reference polling relay loop")
	mode := fs.String("outbox", "table", "table: the outbox table and km0 relay (polling); wal: the WAL-mode outbox and km0 relay --outbox wal, "+
		"on --database-url's server if it has wal_level = logical, else on a private cluster started from "+pgcluster.BinDirDefault)
	proc := fs.Bool("relay-process", false, "run km0 relay as a process of its own, as users run it, instead of in this process beside the writers and the consumer; "+
		"relay_pickup and broker_ack are then not measured")
	profile := cpuProfileFlag(fs)
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	stopProfile, err := profile()
	if err != nil {
		return err
	}
	defer stopProfile()
	if *rate <= 0 || *seconds <= 0 {
		return errors.New("--rate and --seconds must be positive")
	}
	if *mode != "table" && *mode != "wal" {
		return fmt.Errorf("--outbox %q: want table or wal", *mode)
	}
	if *proc && *baseline {
		return errors.New("--relay-process: --baseline runs in this process only")
	}
	url := *dbURL
	if *mode == "wal" {
		if *workers != 0 || *baseline {
			return errors.New("--outbox wal: --workers and --baseline are the polling relay's")
		}
		u, cluster, err := logicalServer(ctx, url)
		if err != nil {
			return err
		}
		if cluster != nil {
			defer cluster.Stop()
		}
		url = u
	}
	if err := relay.CheckSizes(0, *workers, "--batch", "--workers"); err != nil {
		return err
	}
	env, err := newBenchEnv(ctx, url, *brokers, 16)
	if err != nil {
		return err
	}
	defer env.close()
	n := int(float64(*rate) * *seconds)
	if *proc {
		om, bench, extra := outbox.ModeTable, "latency_process", []string(nil)
		if *workers != 0 {
			extra = []string{"--workers", strconv.Itoa(*workers)}
		}
		if *mode == "wal" {
			om, bench, extra = outbox.ModeWAL, "latency_wal_process", []string{"--outbox", "wal"}
		}
		res, err := env.latencyMode(ctx, om, bench, *rate, n, func(ctx context.Context, names migrate.Names, topic string, _ func(string), _ transport.Publisher) error {
			return runRelayProcess(ctx, url, env.addrs, names, topic, extra...)
		})
		if err != nil {
			return err
		}
		res["relay"] = strings.TrimSpace("km0 relay "+strings.Join(extra, " ")) + ", its own process"
		emit(res)
		return nil
	}
	if *mode == "wal" {
		res, err := env.latencyMode(ctx, outbox.ModeWAL, "latency_wal", *rate, n, func(ctx context.Context, names migrate.Names, topic string, picked func(id string), pub transport.Publisher) error {
			r, err := cdc.New(cdc.Config{WAL: true, Config: relay.Config{Pool: env.pool, Names: names, Publisher: pub,
				Topic: topic, Origin: "comandes", Logger: env.log, Transform: pickedTransform(picked)}})
			if err != nil {
				return err
			}
			defer r.Close()
			return r.Run(ctx)
		})
		if err != nil {
			return err
		}
		emit(res)
		return nil
	}
	res, err := env.latency(ctx, "latency", *rate, n, func(ctx context.Context, names migrate.Names, topic string, picked func(id string), pub transport.Publisher) error {
		r, err := relay.New(relay.Config{Pool: env.pool, Names: names, Publisher: pub,
			Topic: topic, Origin: "comandes", Workers: *workers, Logger: env.log, Transform: pickedTransform(picked)})
		if err != nil {
			return err
		}
		return r.Run(ctx)
	})
	if err != nil {
		return err
	}
	emit(res)
	if *baseline {
		res, err := env.latency(ctx, "latency_baseline", *rate, n, func(ctx context.Context, names migrate.Names, topic string, _ func(string), _ transport.Publisher) error {
			return runPort(ctx, env, names, topic, false)
		})
		if err != nil {
			return err
		}
		emit(res)
	}
	return nil
}

// pickedTransform is the relays' Transform in the latency runs: it tells
// picked when the relay has claimed and encoded each event, and changes
// nothing.
func pickedTransform(picked func(id string)) func(*outbox.Row, *envelope.Envelope) ([]*envelope.Envelope, error) {
	return func(_ *outbox.Row, e *envelope.Envelope) ([]*envelope.Envelope, error) {
		picked(e.ID)
		return []*envelope.Envelope{e}, nil
	}
}

// runRelayProcess runs this binary's km0 relay on names' outbox (the
// database at url, env KM0_DATABASE_URL) and topic until ctx ends, then
// stops it with SIGTERM. Its output is returned with its error if it stops
// by itself.
func runRelayProcess(ctx context.Context, url string, brokers []string, names migrate.Names, topic string, extra ...string) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	args := append([]string{"relay", "--brokers", strings.Join(brokers, ","), "--topic", topic, "--origin", "comandes",
		"--schema", names.Schema}, extra...)
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Env = append(os.Environ(), "KM0_DATABASE_URL="+url)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	out := &tailBuffer{max: 16 << 10}
	cmd.Stdout, cmd.Stderr = out, out
	// Pdeathsig fires when the thread that started the child ends, not
	// only the process: good enough for a benchmark's child, which should
	// not outlive it in any case.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	err = cmd.Run()
	switch {
	case ctx.Err() != nil:
		return nil
	case err != nil:
		return fmt.Errorf("km0 relay: %w\n%s", err, out)
	default:
		return fmt.Errorf("km0 relay exited by itself\n%s", out)
	}
}

// latency writes n events at rate (each in its own transaction, from 8
// writers), runs the relay given and km0's consumer (inbox, a transaction
// per batch, its own pool: startConsumer), and measures for each event the
// time from the writer's COMMIT returning to the COMMIT of the consumer's
// transaction that applied it returning.
func (e *benchEnv) latency(ctx context.Context, bench string, rate, n int,
	runRelay func(ctx context.Context, names migrate.Names, topic string, picked func(id string), acked transport.Publisher) error) (map[string]any, error) {
	return e.latencyMode(ctx, outbox.ModeTable, bench, rate, n, runRelay)
}

// latencyMode is latency with the writers' outbox in mode; in WAL mode the
// outbox's slot (migrate.WALSlot, the CDC relay's default) is created
// before the relay starts and anything is written, and dropped at the end.
func (e *benchEnv) latencyMode(ctx context.Context, mode outbox.Mode, bench string, rate, n int,
	runRelay func(ctx context.Context, names migrate.Names, topic string, picked func(id string), acked transport.Publisher) error) (map[string]any, error) {
	s, err := newBenchSchema(ctx, e.pool, migrate.Outbox, migrate.Inbox)
	if err != nil {
		return nil, err
	}
	defer s.drop()
	if mode == outbox.ModeWAL {
		var db string
		if err := e.pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
			return nil, err
		}
		slot := migrate.WALSlot(db, s.Names)
		if _, err := migrate.EnsureWALSlot(ctx, e.pool, slot, slot); err != nil {
			return nil, err
		}
		defer dropSlotNamed(e, slot, slot)
	}
	topic := "bench." + s.Names.Schema
	dropTopic, err := e.topic(ctx, topic)
	if err != nil {
		return nil, err
	}
	defer dropTopic()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	var mu sync.Mutex
	committed := map[string]time.Time{}
	consumed := map[string]time.Time{}
	handled := map[string]time.Time{}  // when the consumer's handler got the event, in its transaction
	pickedAt := map[string]time.Time{} // when the relay built the record (km0 only)
	picked := func(id string) {
		now := time.Now()
		mu.Lock()
		if _, dup := pickedAt[id]; !dup {
			pickedAt[id] = now
		}
		mu.Unlock()
	}
	ackedAt := map[string]time.Time{} // when the broker confirmed the record (km0 only)
	acked := &ackedPublisher{Publisher: kafka.NewPublisher(e.cl), mu: &mu, at: ackedAt}
	relayErr := make(chan error, 1)
	wg.Go(func() { relayErr <- runRelay(ctx, s.Names, topic, picked, acked) })

	progress := make(chan struct{}, 1)
	consumerErr := make(chan error, 1)
	if err := e.startConsumer(ctx, &wg, s.Names, topic, &mu, consumed, handled, progress, consumerErr); err != nil {
		return nil, err
	}

	ob := outbox.New(outbox.Config{Names: s.Names, Mode: mode})
	write := func(ctx context.Context, i int) error {
		ev := &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-2026-%06d", i%1000),
			Type: "comanda.creada", Payload: benchPayload(i)}
		if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, ev) }); err != nil {
			return err
		}
		now := time.Now()
		mu.Lock()
		committed[ev.ID.String()] = now
		mu.Unlock()
		return nil
	}
	waitConsumed := func(want int, limit time.Duration) error {
		deadline := time.After(limit)
		for {
			mu.Lock()
			got := len(consumed)
			mu.Unlock()
			if got >= want {
				return nil
			}
			select {
			case <-progress:
			case err := <-relayErr:
				return fmt.Errorf("relay stopped: %v", err)
			case err := <-consumerErr:
				return fmt.Errorf("consumer stopped: %v", err)
			case <-deadline:
				return fmt.Errorf("%d of %d events consumed after %v", got, want, limit)
			}
		}
	}
	// Warm up: the consumer group has joined and the relay is listening.
	if err := write(ctx, -1); err != nil {
		return nil, err
	}
	if err := waitConsumed(1, 30*time.Second); err != nil {
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	mu.Lock()
	clear(committed)
	clear(consumed)
	clear(pickedAt)
	clear(ackedAt)
	clear(handled)
	mu.Unlock()

	m := startMeter()
	jobs := make(chan int, n)
	writeErr := make(chan error, 8)
	var writers sync.WaitGroup
	for range 8 {
		writers.Go(func() {
			for i := range jobs {
				if err := write(ctx, i); err != nil {
					writeErr <- err
					return
				}
			}
		})
	}
	period := time.Second / time.Duration(rate)
	t0 := time.Now()
	for i := range n {
		if d := time.Until(t0.Add(time.Duration(i) * period)); d > 0 {
			time.Sleep(d) // pacing the writers (open loop), not waiting for work
		}
		jobs <- i
	}
	close(jobs)
	writers.Wait()
	writeSpan := time.Since(t0)
	select {
	case err := <-writeErr:
		return nil, err
	default:
	}
	if err := waitConsumed(n, 60*time.Second); err != nil {
		return nil, err
	}
	_, cpu, rss := m.stop()

	mu.Lock()
	lat, pick, ack, hand := make([]float64, 0, n), make([]float64, 0, n), make([]float64, 0, n), make([]float64, 0, n)
	for id, c := range committed {
		if d, ok := consumed[id]; ok {
			lat = append(lat, float64(d.Sub(c).Microseconds())/1000)
		}
		if p, ok := pickedAt[id]; ok {
			pick = append(pick, float64(p.Sub(c).Microseconds())/1000)
		}
		if a, ok := ackedAt[id]; ok {
			ack = append(ack, float64(a.Sub(c).Microseconds())/1000)
		}
		if h, ok := handled[id]; ok {
			hand = append(hand, float64(h.Sub(c).Microseconds())/1000)
		}
	}
	mu.Unlock()
	if len(lat) < n {
		return nil, fmt.Errorf("only %d of %d events measured", len(lat), n)
	}
	res := map[string]any{"bench": bench, "rate": rate, "events": n,
		"events_per_s": round2(float64(n) / writeSpan.Seconds()),
		"p50_ms":       pct(lat, 0.50), "p90_ms": pct(lat, 0.90), "p99_ms": pct(lat, 0.99), "max_ms": pct(lat, 1),
		"rss_mb": round2(rss), "cpu_us_per_event": round2(float64(cpu.Microseconds()) / float64(n))}
	if len(pick) > 0 { // commit → the relay has claimed and encoded the event
		res["relay_pickup_p50_ms"], res["relay_pickup_p99_ms"] = pct(pick, 0.50), pct(pick, 0.99)
	}
	if len(ack) > 0 { // commit → the broker confirmed the record to the relay
		res["broker_ack_p50_ms"], res["broker_ack_p99_ms"] = pct(ack, 0.50), pct(ack, 0.99)
	}
	if len(hand) > 0 { // commit → the consumer's handler got it (its COMMIT follows)
		res["consumer_handle_p50_ms"], res["consumer_handle_p99_ms"] = pct(hand, 0.50), pct(hand, 0.99)
	}
	return res, nil
}

// ackedPublisher records when the broker confirmed each record (by its
// id_esdeveniment header) of a Publish that succeeded.
type ackedPublisher struct {
	transport.Publisher
	mu *sync.Mutex
	at map[string]time.Time
}

func (p *ackedPublisher) Publish(ctx context.Context, msgs []*transport.Message) error {
	err := p.Publisher.Publish(ctx, msgs)
	if err != nil {
		return err
	}
	now := time.Now()
	p.mu.Lock()
	for _, m := range msgs {
		for _, h := range m.Headers {
			if h.Key == contract.HeaderEventID {
				if _, dup := p.at[h.Value]; !dup {
					p.at[h.Value] = now
				}
			}
		}
	}
	p.mu.Unlock()
	return nil
}

// pct returns the p-quantile of xs (sorting xs).
func pct(xs []float64, p float64) float64 {
	slices.Sort(xs)
	return round2(xs[min(len(xs)-1, int(p*float64(len(xs))))])
}

// startConsumer runs km0's consumer (what users run) on topic, in a
// consumer group and with a pool of its own (a consuming service's), the
// inbox in names, one transaction per batch; an event counts as consumed
// when the transaction that applied it committed (Config.OnCommit), before
// the offset commit. Its error, if it stops early, goes to errc.
func (e *benchEnv) startConsumer(ctx context.Context, wg *sync.WaitGroup, names migrate.Names, topic string, mu *sync.Mutex,
	consumed, handled map[string]time.Time, progress chan struct{}, errc chan error) error {
	pcfg := e.pool.Config().Copy()
	pcfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: e.addrs, Group: names.Schema, Topics: []string{topic}})
	if err != nil {
		pool.Close()
		return err
	}
	c, err := consumer.New(consumer.Config{
		Source: src,
		Pool:   pool, Names: names, Name: "bench.latencia", Logger: e.log,
		Handle: func(_ context.Context, _ pgx.Tx, m *consumer.Message) error {
			now := time.Now()
			mu.Lock()
			if _, dup := handled[m.Envelope.ID]; !dup {
				handled[m.Envelope.ID] = now
			}
			mu.Unlock()
			return nil
		},
		OnCommit: func(_ context.Context, msgs []*consumer.Message) {
			now := time.Now()
			mu.Lock()
			for _, m := range msgs {
				consumed[m.Envelope.ID] = now
			}
			mu.Unlock()
			select {
			case progress <- struct{}{}:
			default:
			}
		},
	})
	if err != nil {
		pool.Close()
		return err
	}
	wg.Go(func() {
		defer pool.Close()
		if err := c.Run(ctx); err != nil && ctx.Err() == nil {
			errc <- err
		}
	})
	return nil
}
