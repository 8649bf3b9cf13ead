// Package consumerbench measures the idempotent consumer: it produces N
// events to an in-process Kafka broker (kfake), some of them malformed, and
// consumes them with consumer.Consumer, each healthy event's key and effect in
// the same PostgreSQL transaction (BatchSize events per transaction), in a
// throwaway schema. `km0 bench consume` and BenchmarkConsume run it.
package consumerbench

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// Defaults of Config.
const (
	NDefault           = 50_000
	KeysDefault        = 1_000
	ConcurrencyDefault = 6
	topic              = "bench.esdeveniments"
	tipus              = "comanda.creada"
)

// Config configures one run.
type Config struct {
	DatabaseURL string       // PostgreSQL server; a schema km0_bench_<random> is created and dropped. Required.
	N           int          // events produced (healthy + poison). Default NDefault.
	PoisonRate  float64      // fraction of malformed-JSON events, in [0, 1). Default 0.
	Keys        int          // distinct agregat_id keys. Default KeysDefault.
	Partitions  int          // partitions of the topic. Default 6.
	BatchSize   int          // consumer.Config.BatchSize. Default consumer.BatchSizeDefault.
	Concurrency int          // consumer.Config.Concurrency and pool size. Default ConcurrencyDefault.
	Logger      *slog.Logger // the consumer's logger. Default: discard.
	// Batch sets consumer.Config.HandleBatch: the effects of a transaction
	// in one multi-row statement instead of one statement per event.
	Batch bool
	// Decode, if set, is consumer.Config.Decode (e.g. a validating
	// schema.Decoder); Validated is copied to the result to label the line.
	Decode    func([]byte) (*envelope.Envelope, error)
	Validated bool
	// PerKey sets consumer.Config.Order to consumer.PerKey (the keyorder
	// tables are created in the schema): with no failures every key is
	// healthy, so the run measures what per-key order costs healthy keys.
	PerKey bool
}

// Result is one run's figures; it marshals to the JSON line of `km0 bench`.
type Result struct {
	Bench        string  `json:"bench"`
	N            int     `json:"n"`
	PoisonRate   float64 `json:"poison_rate"`
	EventsPerS   float64 `json:"events_per_s"`  // every record finished (healthy + dead-lettered) per second
	HealthyPerS  float64 `json:"healthy_per_s"` // healthy events processed per second
	Processed    int64   `json:"processed"`
	DeadLettered int64   `json:"dead_lettered"`
	Seconds      float64 `json:"seconds"`
	BatchSize    int     `json:"batch_size"`
	Concurrency  int     `json:"concurrency"`
	Partitions   int     `json:"partitions"`
	Handler      string  `json:"handler"`   // "message" (one statement per event) or "batch" (HandleBatch)
	Validated    bool    `json:"validated"` // events decoded by a validating schema.Decoder
	Order        string  `json:"order"`     // "unordered" or "per-key" (consumer.Config.Order)
}

// Run produces, consumes and checks: the effect table must hold exactly one
// effect per healthy event, else Run returns an error.
func Run(ctx context.Context, cfg Config) (Result, error) {
	cfg.N = cmp.Or(cfg.N, NDefault)
	cfg.Keys = cmp.Or(cfg.Keys, KeysDefault)
	cfg.Partitions = cmp.Or(cfg.Partitions, kafka.PartitionsDefault)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, consumer.BatchSizeDefault)
	cfg.Concurrency = cmp.Or(cfg.Concurrency, ConcurrencyDefault)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.PoisonRate < 0 || cfg.PoisonRate >= 1 || math.IsNaN(cfg.PoisonRate) {
		return Result{}, fmt.Errorf("consumerbench: poison rate %v not in [0, 1)", cfg.PoisonRate)
	}
	if cfg.DatabaseURL == "" {
		return Result{}, errors.New("consumerbench: no database URL")
	}
	res := Result{Bench: "consume", N: cfg.N, PoisonRate: cfg.PoisonRate, BatchSize: cfg.BatchSize,
		Concurrency: cfg.Concurrency, Partitions: cfg.Partitions, Handler: "message", Validated: cfg.Validated, Order: "unordered"}
	order := consumer.Unordered
	if cfg.PerKey {
		res.Order, order = "per-key", consumer.PerKey
	}
	if cfg.Batch {
		res.Handler = "batch"
	}

	pool, schema, cleanup, err := throwawaySchema(ctx, cfg.DatabaseURL, int32(cfg.Concurrency))
	if err != nil {
		return res, err
	}
	defer cleanup()
	broker, err := kafkaembed.Start(kafkaembed.Config{Partitions: cfg.Partitions, Topics: []string{topic}})
	if err != nil {
		return res, err
	}
	defer broker.Close()
	healthy, err := produce(ctx, broker.Addrs(), cfg)
	if err != nil {
		return res, err
	}

	table := pgx.Identifier{schema, "bench_efectes"}.Sanitize()
	upsert := "INSERT INTO " + table + " (agregat_id, n) VALUES ($1, 1) ON CONFLICT (agregat_id) DO UPDATE SET n = " + table + ".n + 1"
	upsertAll := "INSERT INTO " + table + " (agregat_id, n) SELECT k, count(*) FROM unnest($1::text[]) k GROUP BY k " +
		"ON CONFLICT (agregat_id) DO UPDATE SET n = " + table + ".n + EXCLUDED.n"
	var first atomic.Int64
	var handleBatch consumer.BatchHandler
	if cfg.Batch {
		handleBatch = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			first.CompareAndSwap(0, time.Now().UnixNano())
			keys := make([]string, len(msgs))
			for i, m := range msgs {
				keys[i] = string(m.Key)
			}
			_, err := tx.Exec(ctx, upsertAll, keys)
			return err
		}
	}
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: broker.Addrs(), Group: "bench", Topics: []string{topic},
		TopicPartitions: int32(cfg.Partitions)})
	if err != nil {
		return Result{}, err
	}
	c, err := consumer.New(consumer.Config{
		HandleBatch: handleBatch, Decode: cfg.Decode, Order: order,
		Source: src,
		Name:   "bench.consum",
		Pool:   pool, Names: migrate.Names{Schema: schema}, Types: []string{tipus},
		BatchSize: cfg.BatchSize, Concurrency: cfg.Concurrency, Logger: cfg.Logger,
		Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			first.CompareAndSwap(0, time.Now().UnixNano())
			_, err := tx.Exec(ctx, upsert, string(m.Key))
			return err
		},
	})
	if err != nil {
		return res, err
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	var end time.Time
	for end.IsZero() {
		select {
		case err := <-done:
			stop()
			return res, fmt.Errorf("consumerbench: consumer stopped early: %w", err)
		case <-ctx.Done():
			stop()
			<-done
			return res, ctx.Err()
		case <-tick.C:
			if st := c.Stats(); st.Processed+st.DeadLettered >= int64(cfg.N) {
				end = time.Now()
			}
		}
	}
	stop()
	if err := <-done; err != nil {
		return res, err
	}
	st := c.Stats()
	secs := end.Sub(time.Unix(0, first.Load())).Seconds()
	res.Processed, res.DeadLettered, res.Seconds = st.Processed, st.DeadLettered, secs
	res.EventsPerS = math.Round(float64(cfg.N) / secs)
	res.HealthyPerS = math.Round(float64(st.Processed) / secs)

	var effects int64
	if err := pool.QueryRow(ctx, "SELECT coalesce(sum(n), 0) FROM "+table).Scan(&effects); err != nil {
		return res, err
	}
	if effects != int64(healthy) || st.Processed != int64(healthy) || st.Duplicates != 0 {
		return res, fmt.Errorf("consumerbench: %d effects and %d processed for %d healthy events (%d duplicates)",
			effects, st.Processed, healthy, st.Duplicates)
	}
	return res, nil
}

// produce writes cfg.N events round-robin over cfg.Keys keys; a fraction
// cfg.PoisonRate of them, evenly spread, is malformed JSON. It returns the
// number of healthy events.
func produce(ctx context.Context, brokers []string, cfg Config) (int, error) {
	cl, err := kafka.NewClient(brokers)
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	healthy := 0
	recs := make([]*kgo.Record, 0, 10_000)
	flush := func() error {
		err := cl.ProduceSync(ctx, recs...).FirstErr()
		recs = recs[:0]
		return err
	}
	for i := range cfg.N {
		id := uuid.NewString()
		key := "A-" + strconv.Itoa(i%cfg.Keys)
		var v string
		if poison := math.Floor(float64(i+1)*cfg.PoisonRate) > math.Floor(float64(i)*cfg.PoisonRate); poison {
			v = `{"id_esdeveniment":"` + id + `","tipus":"` + tipus + `","versio":1,"dades":{"linies":[` // cut short
		} else {
			healthy++
			v = `{"id_esdeveniment":"` + id + `","tipus":"` + tipus + `","versio":1,"data_ms":1789000000000,"origen":"bench",` +
				`"dades":{"id":"` + key + `","client":"anna","mercat":"girona","linies":[{"producte":"tomaquet-rosa","quantitat":2,"preu_centims":350}]}}`
		}
		recs = append(recs, &kgo.Record{Topic: topic, Key: []byte(key), Value: []byte(v), Headers: []kgo.RecordHeader{
			{Key: "tipus", Value: []byte(tipus)}, {Key: "id_esdeveniment", Value: []byte(id)}}})
		if len(recs) == cap(recs) {
			if err := flush(); err != nil {
				return 0, err
			}
		}
	}
	return healthy, flush()
}

// throwawaySchema creates km0_bench_<random> with the inbox table and the
// effect table, and returns a pool and a cleanup that drops it.
func throwawaySchema(ctx context.Context, url string, conns int32) (*pgxpool.Pool, string, func(), error) {
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, "", nil, errors.New("consumerbench: invalid database URL (not shown: it may hold a password)")
	}
	pcfg.MaxConns = conns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, "", nil, fmt.Errorf("consumerbench: database: %w", err)
	}
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	schema := "km0_bench_" + hex.EncodeToString(b)
	cleanup := func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(cctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		pool.Close()
	}
	if _, err := migrate.Up(ctx, pool, migrate.Names{Schema: schema}, migrate.Inbox, keyorder.Migrations); err != nil {
		cleanup()
		return nil, "", nil, fmt.Errorf("consumerbench: %w", err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{schema, "bench_efectes"}.Sanitize()+
		" (agregat_id TEXT PRIMARY KEY, n INTEGER NOT NULL)"); err != nil {
		cleanup()
		return nil, "", nil, fmt.Errorf("consumerbench: %w", err)
	}
	return pool, schema, cleanup, nil
}
