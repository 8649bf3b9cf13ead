package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport/kafka"
)

func init() { registerBench("commit", benchCommit) }

// The sides of `km0 bench commit`.
const (
	commitPlain     = "plain"          // INSERT into a table with no trigger (the peers' outbox)
	commitTable     = "table"          // outbox.Enqueue into km0's table, its triggers
	commitNoLock    = "table_nolock"   // the table without the per-aggregate advisory lock (measurement only)
	commitNoNotify  = "table_nonotify" // the table without the NOTIFY trigger (measurement only)
	commitWAL       = "wal"            // outbox.ModeWAL
	commitSidesDflt = commitPlain + "," + commitTable + "," + commitNoLock + "," + commitNoNotify + "," + commitWAL
)

// benchCommit is `km0 bench commit`: the writers' own commit latency at a
// fixed rate (default 1,000 events/s from 16 writers, one event a
// transaction, each writer paced on its share of the rate), for each side
// in the same run on a fresh schema, rounds rotating the order. Timed from
// BEGIN to COMMIT returned. One JSON line per side and round, then the
// side-by-side line (medians of the rounds) with the ratios to plain.
func benchCommit(ctx context.Context, args []string) error {
	fs := cli.NewFlags("bench commit", "the writers' commit p50/p99 at a fixed rate: km0's outbox table, the WAL mode and a plain INSERT (no trigger); one JSON line per result")
	dbURL := cli.SecretString(fs, "database-url", benchDatabaseURL(), "PostgreSQL URL (default $KM0_DATABASE_URL, else the local server); throwaway schemas; "+
		"with --sides wal, a server with wal_level = logical, else a private cluster started from "+pgcluster.BinDirDefault+" (every side then runs there)")
	rate := fs.Int("rate", 1000, "events per second, all writers together")
	writers := fs.Int("writers", 16, "concurrent writers, each its own connection")
	seconds := fs.Float64("seconds", 5, "how long each side writes")
	aggs := fs.Int("aggregates", 1000, "distinct agregat_id values")
	rounds := fs.Int("rounds", 1, "repeat, rotating the order of the sides; the summary gives the medians")
	sidesFlag := fs.String("sides", commitSidesDflt, "comma-separated sides: "+commitSidesDflt)
	brokers := benchBrokersFlag(fs)
	withRelay := fs.Bool("relay", true, "run each outbox side's relay while it writes, with its defaults (the table's: km0 relay, polling with LISTEN; "+
		"wal: km0 relay --outbox wal), publishing to --brokers; plain has none")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *rate <= 0 || *writers <= 0 || *seconds <= 0 || *aggs <= 0 || *rounds <= 0 {
		return errors.New("--rate, --writers, --seconds, --aggregates and --rounds must be positive")
	}
	sides := strings.Split(*sidesFlag, ",")
	for _, s := range sides {
		if !slices.Contains(strings.Split(commitSidesDflt, ","), s) {
			return fmt.Errorf("--sides: unknown side %q (have %s)", s, commitSidesDflt)
		}
	}
	url, cluster := *dbURL, (*pgcluster.Cluster)(nil)
	if slices.Contains(sides, commitWAL) {
		var err error
		if url, cluster, err = logicalServer(ctx, *dbURL); err != nil {
			return err
		}
		if cluster != nil {
			defer cluster.Stop()
		}
	}
	var env *benchEnv
	if *withRelay {
		var err error
		if env, err = newBenchEnv(ctx, url, *brokers, int32(*writers+8)); err != nil {
			return err
		}
	} else {
		pool, err := cli.OpenPool(ctx, url, int32(*writers+2))
		if err != nil {
			return err
		}
		env = &benchEnv{pool: pool}
	}
	defer env.close()
	load0 := loadAverage()
	med := map[string]map[string][]float64{}
	for round := 1; round <= *rounds; round++ {
		for i := range sides {
			side := sides[(i+round-1)%len(sides)]
			res, err := commitSide(ctx, env, side, *rate, *writers, *aggs, time.Duration(*seconds*float64(time.Second)))
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round, side, err)
			}
			res["round"] = round
			emit(res)
			if med[side] == nil {
				med[side] = map[string][]float64{}
			}
			for _, k := range []string{"p50_ms", "p99_ms", "events_per_s"} {
				med[side][k] = append(med[side][k], res[k].(float64))
			}
		}
	}
	out := map[string]any{"bench": "commit", "rate": *rate, "writers": *writers, "seconds": *seconds, "aggregates": *aggs, "rounds": *rounds,
		"what": "one event a transaction, BEGIN → COMMIT returned, each writer paced at rate/writers; medians of the rounds; " +
			map[bool]string{true: "each outbox side's relay running (plain: none)", false: "no relay running"}[*withRelay],
		"relay":               *withRelay,
		"server":              map[bool]string{true: "private cluster (wal_level = logical, fsync on)", false: "--database-url"}[cluster != nil],
		"load_average_before": load0, "load_average_after": loadAverage()}
	for _, s := range sides {
		out[s+"_p50_ms"], out[s+"_p99_ms"] = med2(med[s]["p50_ms"]), med2(med[s]["p99_ms"])
		if s != commitPlain && med[commitPlain] != nil {
			out[s+"_p99_vs_plain"] = ratio(median(med[s]["p99_ms"]), median(med[commitPlain]["p99_ms"]))
		}
	}
	emit(out)
	return nil
}

// commitSide runs one side on a fresh schema and returns its result line.
func commitSide(ctx context.Context, env *benchEnv, side string, rate, writers, aggs int, d time.Duration) (map[string]any, error) {
	pool := env.pool
	s, err := newBenchSchema(ctx, pool, migrate.Outbox)
	if err != nil {
		return nil, err
	}
	defer s.drop()
	schema := pgx.Identifier{s.Names.Schema}.Sanitize()
	table := pgx.Identifier{s.Names.Schema, s.Names.Outbox}.Sanitize()
	plain := pgx.Identifier{s.Names.Schema, "plain"}.Sanitize()
	ob := outbox.New(outbox.Config{Names: s.Names})
	write := func(ctx context.Context, tx pgx.Tx, k int) error {
		return ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-2026-%06d", k%aggs),
			Type: "comanda.creada", Payload: benchPayload(k)})
	}
	switch side {
	case commitPlain:
		if _, err := pool.Exec(ctx, "CREATE TABLE "+plain+" (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), agregat text NOT NULL, "+
			"agregat_id text NOT NULL, tipus text NOT NULL, carrega jsonb NOT NULL, creat_en timestamptz NOT NULL DEFAULT now())"); err != nil {
			return nil, err
		}
		write = func(ctx context.Context, tx pgx.Tx, k int) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+plain+" (agregat, agregat_id, tipus, carrega) VALUES ('comanda', $1, 'comanda.creada', $2)",
				fmt.Sprintf("P-2026-%06d", k%aggs), benchPayload(k))
			return err
		}
	case commitNoLock:
		if _, err := pool.Exec(ctx, "CREATE OR REPLACE FUNCTION "+schema+".km0_outbox_ordre() RETURNS trigger LANGUAGE plpgsql AS "+
			"$$ BEGIN NEW.creat_en := clock_timestamp(); RETURN NEW; END $$"); err != nil {
			return nil, err
		}
	case commitNoNotify:
		if _, err := pool.Exec(ctx, "DROP TRIGGER km0_outbox_avis ON "+table); err != nil {
			return nil, err
		}
	case commitWAL:
		var db string
		if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
			return nil, err
		}
		slot := migrate.WALSlot(db, s.Names)
		if _, err := migrate.EnsureWALSlot(ctx, pool, slot, slot); err != nil {
			return nil, err
		}
		defer func() {
			c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, _ = pool.Exec(c, "SELECT pg_drop_replication_slot($1)", slot)
			_, _ = pool.Exec(c, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{slot}.Sanitize())
		}()
		ob = outbox.New(outbox.Config{Names: s.Names, Mode: outbox.ModeWAL, Slot: slot})
	}
	if env.cl != nil && side != commitPlain {
		topic := "bench." + s.Names.Schema
		dropTopic, err := env.topic(ctx, topic)
		if err != nil {
			return nil, err
		}
		defer dropTopic()
		rcfg := relay.Config{Pool: pool, Names: s.Names, Publisher: kafka.NewPublisher(env.cl), Topic: topic, Origin: "comandes", Logger: env.log}
		var stop func() error
		if side == commitWAL {
			r, err := cdc.New(cdc.Config{Config: rcfg, WAL: true})
			if err != nil {
				return nil, err
			}
			stop = background(ctx, r.Run, r.Close)
		} else {
			r, err := relay.New(rcfg)
			if err != nil {
				return nil, err
			}
			stop = background(ctx, r.Run, r.Close)
		}
		defer func() { _ = stop() }()
	}
	lat := make([][]time.Duration, writers)
	errs := make([]error, writers)
	every := time.Duration(float64(time.Second) * float64(writers) / float64(rate))
	t0 := time.Now()
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				errs[w] = err
				return
			}
			defer conn.Release()
			// Writers start spread over one interval, each on its own schedule.
			next := t0.Add(every * time.Duration(w) / time.Duration(writers))
			for k := w; ; k += writers {
				if time.Until(next) > 0 {
					time.Sleep(time.Until(next)) // pacing the load, not waiting for work
				}
				if time.Since(t0) >= d {
					return
				}
				start := time.Now()
				if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return write(ctx, tx, k) }); err != nil {
					errs[w] = err
					return
				}
				lat[w] = append(lat[w], time.Since(start))
				next = next.Add(every)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(t0)
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	var all []time.Duration
	for _, l := range lat {
		all = append(all, l...)
	}
	slices.Sort(all)
	return map[string]any{"bench": "commit_" + side, "events": len(all), "events_per_s": perSecond(len(all), elapsed),
		"p50_ms": pctl(all, 50), "p99_ms": pctl(all, 99), "max_ms": pctl(all, 100)}, nil
}
