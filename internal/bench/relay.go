package bench

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/schema"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

func init() {
	registerBench("relay", benchRelay)
	registerBench("latency", benchLatency)
}

// benchPayload is a comanda.creada of the contract, about 150 bytes.
func benchPayload(i int) json.RawMessage {
	return json.RawMessage(fmt.Sprintf(`{"id":"P-2026-%06d","client":"anna","mercat":"girona",`+
		`"linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450},`+
		`{"producte":"tomaquet-rosa","quantitat":1,"preu_centims":320}]}`, i))
}

// benchEnv is what a benchmark needs: a pool, a broker (in-process unless
// external brokers were given) and a client for it.
type benchEnv struct {
	pool   *pgxpool.Pool
	broker *kafkaembed.Broker // nil with external brokers
	addrs  []string           // the brokers' addresses
	cl     *kgo.Client
	log    *slog.Logger
}

// benchBrokersFlag is --brokers of the benchmarks: empty runs kfake in the
// benchmark's own process.
func benchBrokersFlag(fs *flag.FlagSet) *string {
	return fs.String("brokers", "", "Kafka brokers to publish to, comma separated, e.g. a `km0 kafka --addr 127.0.0.1:9092` "+
		"in another process (default: kfake in this process); throwaway topics are created and deleted")
}

func newBenchEnv(ctx context.Context, dbURL, brokers string, conns int32) (*benchEnv, error) {
	pool, err := cli.OpenPool(ctx, dbURL, conns)
	if err != nil {
		return nil, err
	}
	e := &benchEnv{pool: pool, addrs: kafka.SplitBrokers(brokers), log: cli.Logger()}
	if len(e.addrs) == 0 {
		if e.broker, err = kafkaembed.Start(kafkaembed.Config{}); err != nil {
			pool.Close()
			return nil, err
		}
		e.addrs = e.broker.Addrs()
	}
	if e.cl, err = kafka.NewClient(e.addrs); err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

func (e *benchEnv) close() {
	if e.cl != nil {
		e.cl.Close()
	}
	if e.broker != nil {
		e.broker.Close()
	}
	e.pool.Close()
}

// topic creates a fresh topic; the returned func deletes it (freeing kfake's
// memory between runs).
func (e *benchEnv) topic(ctx context.Context, name string) (func(), error) {
	if err := kafka.EnsureTopics(ctx, e.cl, kafka.PartitionsDefault, name); err != nil {
		return nil, err
	}
	return func() {
		_, _ = kadm.NewClient(e.cl).DeleteTopics(context.Background(), name)
		runtime.GC()
		debug.FreeOSMemory()
	}, nil
}

// records counts the records of topic.
func (e *benchEnv) records(ctx context.Context, topic string) (int64, error) {
	ends, err := kadm.NewClient(e.cl).ListEndOffsets(ctx, topic)
	if err != nil {
		return 0, err
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
	return n, ends.Error()
}

// fill writes n pending rows on aggs aggregates, in transactions of 5,000.
func fill(ctx context.Context, pool *pgxpool.Pool, names migrate.Names, n, aggs int) error {
	ob := outbox.New(outbox.Config{Names: names})
	for done := 0; done < n; {
		chunk := min(5000, n-done)
		events := make([]*outbox.Event, chunk)
		for i := range events {
			k := done + i
			events[i] = &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-2026-%06d", k%aggs),
				Type: "comanda.creada", Payload: benchPayload(k)}
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.EnqueueBatch(ctx, tx, events) }); err != nil {
			return err
		}
		done += chunk
	}
	_, err := pool.Exec(ctx, "VACUUM ANALYZE "+pgx.Identifier{names.Schema, names.Outbox}.Sanitize())
	return err
}

func benchRelay(ctx context.Context, args []string) error {
	fs := cli.NewFlags("bench relay", "move N pre-inserted outbox rows to Kafka (kfake in this process, or --brokers) with km0 relay's defaults; one JSON line per result")
	dbURL := cli.SecretString(fs, "database-url", benchDatabaseURL(), "PostgreSQL URL (default $KM0_DATABASE_URL, else the local server); a throwaway schema is used and dropped")
	brokers := benchBrokersFlag(fs)
	n := fs.Int("n", 50_000, "rows to move")
	aggs := fs.Int("aggregates", 10_000, "distinct agregat_id values")
	batch := fs.Int("batch", 0, "km0 relay: rows per claim; 0 (the relay's default) adapts to the backlog")
	workers := fs.Int("workers", 0, "km0 relay: claim workers; 0 (the relay's default) adapts to the backlog")
	baseline := fs.Bool("baseline", false, "also run a straight Go port of the reference polling relay loop (LOT 100) and print the ratio")
	rounds := fs.Int("rounds", 1, "repeat (alternating with the baseline) and report the best round, with the median")
	validate := fs.Bool("validate", false, "also measure the write side (outbox.EnqueueBatch, 100 events a transaction) with and without JSON Schema validation, and print the ratio")
	mode := fs.String("mode", modePolling, "polling: km0 relay (with --baseline, beside the seed's loop); cdc: km0 relay --mode cdc beside km0 relay (polling) in the same run, "+
		"half the rows pre-inserted and half written live, then their latency; on --database-url's server if it has wal_level = logical, else on a private cluster started from "+pgcluster.BinDirDefault)
	del := fs.Bool("delete-published", false, "--mode cdc: both relays delete each row once the broker confirmed it instead of setting publicat_en (km0 relay --delete-published)")
	latRate := fs.Int("latency-rate", 1000, "--mode cdc: events/s of the latency run of each relay (commit → consumer commit, as `km0 bench latency`; with --outbox wal, of each side); 0 skips it")
	latSeconds := fs.Float64("latency-seconds", 5, "--mode cdc: how long each latency run writes")
	outboxMode := fs.String("outbox", string(outbox.ModeTable), "--mode cdc: wal runs four sides instead, live writes only "+
		"(4 writers, transactions of 100, --aggregates default 1,000), each side's first write to its last record on the topic: "+
		"the WAL-mode outbox with km0 relay --outbox wal, the table with km0 relay --mode cdc, the table with km0 relay (polling), and the table with the seed's relay ported to Go")
	profile := cpuProfileFlag(fs)
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	stopProfile, err := profile()
	if err != nil {
		return err
	}
	defer stopProfile()
	if *n <= 0 || *aggs <= 0 || *rounds <= 0 {
		return errors.New("--n, --aggregates and --rounds must be positive")
	}
	if err := relay.CheckSizes(*batch, *workers, "--batch", "--workers"); err != nil {
		return err
	}
	switch *mode {
	case modePolling:
		if *del {
			return errors.New("--delete-published applies to --mode cdc only")
		}
		if *outboxMode != string(outbox.ModeTable) {
			return errors.New("--outbox applies to --mode cdc only")
		}
	case modeCDC:
		if *baseline || *validate {
			return errors.New("--baseline and --validate apply to --mode polling only")
		}
		if *latRate < 0 || *latSeconds <= 0 {
			return errors.New("--latency-rate must not be negative and --latency-seconds must be positive")
		}
		switch *outboxMode {
		case string(outbox.ModeTable):
		case string(outbox.ModeWAL):
			if *del || *batch != 0 || *workers != 0 {
				return errors.New("--outbox wal runs every relay with its defaults: --delete-published, --batch and --workers do not apply")
			}
			a := 1000
			fs.Visit(func(f *flag.Flag) {
				if f.Name == "aggregates" {
					a = *aggs
				}
			})
			return benchRelayWAL(ctx, *dbURL, *brokers, *n, a, *rounds, *latRate, *latSeconds)
		default:
			return fmt.Errorf("--outbox %q: want %s or %s", *outboxMode, outbox.ModeTable, outbox.ModeWAL)
		}
		return benchRelayCDC(ctx, *dbURL, *brokers, *n, *aggs, *rounds, *batch, *workers, *latRate, *latSeconds, *del)
	default:
		return fmt.Errorf("--mode %q: want %s or %s", *mode, modePolling, modeCDC)
	}
	env, err := newBenchEnv(ctx, *dbURL, *brokers, 4)
	if err != nil {
		return err
	}
	defer env.close()
	contenders := []struct {
		bench string
		move  func(ctx context.Context, names migrate.Names, topic string, n int) error
		extra map[string]any
	}{
		{"relay", func(ctx context.Context, names migrate.Names, topic string, n int) error {
			return runKm0Until(ctx, env, names, topic, n, *batch, *workers)
		}, map[string]any{"batch": adaptiveOr(*batch), "workers": adaptiveOr(*workers), "broker": brokerKind(env)}},
		{"relay_baseline", func(ctx context.Context, names migrate.Names, topic string, _ int) error {
			return runPort(ctx, env, names, topic, true)
		}, map[string]any{"batch": portBatch, "broker": brokerKind(env)}},
	}
	if !*baseline {
		contenders = contenders[:1]
	}
	// Rounds alternate the contenders so that both see the same machine.
	results := make([][]map[string]any, len(contenders))
	for range *rounds {
		for i, c := range contenders {
			res, err := env.moveRows(ctx, c.bench, *n, *aggs, c.move)
			if err != nil {
				return err
			}
			results[i] = append(results[i], res)
		}
	}
	best := make([]map[string]any, len(contenders))
	for i, c := range contenders {
		best[i] = summarize(results[i])
		for k, v := range c.extra {
			best[i][k] = v
		}
		emit(best[i])
	}
	if *validate {
		if err := benchWriteValidation(ctx, env, *n, *aggs, *rounds); err != nil {
			return err
		}
	}
	if *baseline {
		emit(map[string]any{"bench": "relay_vs_baseline", "events_per_s": best[0]["events_per_s"],
			"baseline_events_per_s": best[1]["events_per_s"],
			"ratio":                 round2(best[0]["events_per_s"].(float64) / best[1]["events_per_s"].(float64)),
			"median_ratio":          round2(best[0]["median_events_per_s"].(float64) / best[1]["median_events_per_s"].(float64)),
			"batch":                 best[0]["batch"], "workers": best[0]["workers"], "broker": best[0]["broker"], "rounds": *rounds})
	}
	return nil
}

// brokerKind says where the benchmark's broker runs.
func brokerKind(e *benchEnv) string {
	if e.broker != nil {
		return "kfake in this process"
	}
	return "external: " + strings.Join(e.addrs, ",")
}

// summarize returns the round with the most events/s, with the median of all
// rounds and their count added.
func summarize(rounds []map[string]any) map[string]any {
	rate := func(m map[string]any) float64 { return m["events_per_s"].(float64) }
	sorted := slices.Clone(rounds)
	slices.SortFunc(sorted, func(a, b map[string]any) int { return cmp.Compare(rate(a), rate(b)) })
	best := sorted[len(sorted)-1]
	best["rounds"] = len(rounds)
	best["median_events_per_s"] = rate(sorted[(len(sorted)-1)/2])
	return best
}

// moveRows fills a fresh schema with n rows, runs move until they are all
// published, checks the topic holds them and returns the result line.
func (e *benchEnv) moveRows(ctx context.Context, bench string, n, aggs int,
	move func(ctx context.Context, names migrate.Names, topic string, n int) error) (map[string]any, error) {
	s, err := newBenchSchema(ctx, e.pool, migrate.Outbox)
	if err != nil {
		return nil, err
	}
	defer s.drop()
	if err := fill(ctx, e.pool, s.Names, n, aggs); err != nil {
		return nil, fmt.Errorf("fill: %w", err)
	}
	topic := "bench." + s.Names.Schema // a new name each round: a recreated topic gets a new id
	dropTopic, err := e.topic(ctx, topic)
	if err != nil {
		return nil, err
	}
	defer dropTopic()
	m := startMeter()
	if err := move(ctx, s.Names, topic, n); err != nil {
		return nil, fmt.Errorf("%s: %w", bench, err)
	}
	elapsed, cpu, rss := m.stop()
	recs, err := e.records(ctx, topic)
	if err != nil {
		return nil, err
	}
	if recs < int64(n) {
		return nil, fmt.Errorf("%s: topic holds %d records, want %d", bench, recs, n)
	}
	return map[string]any{"bench": bench, "events": n, "records": recs, "seconds": round2(elapsed.Seconds()),
		"events_per_s": round2(float64(n) / elapsed.Seconds()), "rss_mb": round2(rss),
		"cpu_us_per_event": round2(float64(cpu.Microseconds()) / float64(n))}, nil
}

// runKm0Until runs the km0 relay until n rows are marked published.
func runKm0Until(ctx context.Context, env *benchEnv, names migrate.Names, topic string, n, batch, workers int) error {
	var published atomic.Int64
	r, err := relay.New(relay.Config{Pool: env.pool, Names: names, Publisher: kafka.NewPublisher(env.cl),
		Topic: topic, Origin: "comandes", BatchSize: batch, Workers: workers, Logger: env.log})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	// The probe counts confirmed rows (internal/faults: a test seam, not API).
	probe := faults.Relay{AfterPublish: func(rows int) error { published.Add(int64(rows)); return nil }}
	go func() { done <- r.Run(faults.WithRelay(ctx, probe)) }()
	defer func() { cancel(); <-done }()
	for {
		if published.Load() >= int64(n) {
			lag, err := r.Lag(ctx)
			if err != nil {
				return err
			}
			if lag.Pending == 0 {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-done:
			return fmt.Errorf("relay stopped: %v", err)
		case <-time.After(time.Millisecond):
		}
	}
}

// benchWriteValidation measures where validation happens on the producer
// side: Outbox.EnqueueBatch of n events (100 a transaction) into a fresh
// schema, without and with schema.Registry.Validate, alternating for rounds.
func benchWriteValidation(ctx context.Context, env *benchEnv, n, aggs, rounds int) error {
	reg, err := schema.Default()
	if err != nil {
		return err
	}
	rates := map[bool][]float64{}
	for range rounds {
		for _, validated := range []bool{false, true} {
			s, err := newBenchSchema(ctx, env.pool, migrate.Outbox)
			if err != nil {
				return err
			}
			cfg := outbox.Config{Names: s.Names}
			if validated {
				cfg.Validate = reg.Validate
			}
			ob := outbox.New(cfg)
			start := time.Now()
			for done := 0; done < n; {
				events := make([]*outbox.Event, min(100, n-done))
				for i := range events {
					k := done + i
					events[i] = &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-2026-%06d", k%aggs),
						Type: "comanda.creada", Payload: benchPayload(k)}
				}
				if err := pgx.BeginFunc(ctx, env.pool, func(tx pgx.Tx) error { return ob.EnqueueBatch(ctx, tx, events) }); err != nil {
					s.drop()
					return err
				}
				done += len(events)
			}
			rate := round2(float64(n) / time.Since(start).Seconds())
			s.drop()
			rates[validated] = append(rates[validated], rate)
			emit(map[string]any{"bench": "relay_write", "validated": validated, "events": n, "events_per_s": rate})
		}
	}
	off, on := median(rates[false]), median(rates[true])
	emit(map[string]any{"bench": "relay_write_validation", "events_per_s": on, "validated_events_per_s": on,
		"unvalidated_events_per_s": off, "ratio": round2(on / off), "rounds": rounds, "target_met": on/off >= 0.90})
	return nil
}
