package bench

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// The sides of `km0 bench relay --mode cdc --outbox wal`.
const (
	benchWAL = "relay_wal"
	// benchSeedPort is the seed's relay, ported to Go (runPort).
	benchSeedPort = "relay_seed_port"
	// walBenchWriters and walBenchTx are the live load: 4 writers,
	// transactions of 100 events.
	walBenchWriters = 4
	walBenchTx      = 100
)

// walSide is one side of the WAL benchmark: how its events are written and
// which relay publishes them.
type walSide struct {
	name string
	mode outbox.Mode
	cdc  bool
	port bool // the seed's relay, ported (runPort), on the table
}

// benchRelayWAL is `km0 bench relay --mode cdc --outbox wal`: the WAL-mode
// outbox with km0 relay --outbox wal, the table with km0 relay --mode cdc,
// and the table with km0 relay (polling), each with its defaults, rounds
// alternating the order, each side on a fresh schema; live writes only
// (walBenchWriters writers, transactions of walBenchTx, aggs aggregates),
// timed from the first write to the last record on the topic. One JSON line
// per side and round, then the side-by-side line with the ratios.
//
// Then, with latRate > 0, the commit → consumer commit latency of each side
// at latRate events/s for latSeconds (env.latencyMode: 8 writers, one event
// a transaction; the consumer records each with inbox.Process and commits
// its offset), rounds rotating the order, and its side-by-side line.
func benchRelayWAL(ctx context.Context, dbURL, brokers string, n, aggs, rounds, latRate int, latSeconds float64) error {
	url, cluster, err := logicalServer(ctx, dbURL)
	if err != nil {
		return err
	}
	if cluster != nil {
		defer cluster.Stop()
	}
	env, err := newBenchEnv(ctx, url, brokers, 8)
	if err != nil {
		return err
	}
	defer env.close()
	srv := newServerMeter(ctx, cluster, env.pool)
	load0 := loadAverage()
	sides := []walSide{{benchWAL, outbox.ModeWAL, true, false}, {benchCDC, outbox.ModeTable, true, false},
		{benchPolling, outbox.ModeTable, false, false}, {benchSeedPort, outbox.ModeTable, false, true}}
	med := map[string]map[string][]float64{}
	for round := 1; round <= rounds; round++ {
		for i := range sides {
			side := sides[(i+round-1)%len(sides)] // rotate the order
			res, err := env.moveWritten(ctx, side, n, aggs, srv)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round, side.name, err)
			}
			res["round"] = round
			emit(res)
			if med[side.name] == nil {
				med[side.name] = map[string][]float64{}
			}
			for _, k := range []string{"events_per_s", "writers_seconds", "cpu_us_per_event", "server_cpu_us_per_event"} {
				if v, ok := res[k].(float64); ok {
					med[side.name][k] = append(med[side.name][k], v)
				}
			}
		}
	}
	m := func(side, k string) float64 { return med2(med[side][k]) }
	out := map[string]any{"bench": "relay_wal_vs_cdc_vs_polling", "events": n, "rounds": rounds, "aggregates": aggs,
		"writers": walBenchWriters, "events_per_transaction": walBenchTx,
		"what": "live writes only, first write → last record on the topic; wal: outbox.ModeWAL + km0 relay --outbox wal; " +
			"cdc: the table + km0 relay --mode cdc; polling: the table + km0 relay; medians of the rounds; " +
			"cpu_us_per_event is this process (writers, relay, " + brokerKind(env) + ")",
		"wal_events_per_s": m(benchWAL, "events_per_s"), "cdc_events_per_s": m(benchCDC, "events_per_s"),
		"polling_events_per_s": m(benchPolling, "events_per_s"), "seed_port_events_per_s": m(benchSeedPort, "events_per_s"),
		"wal_vs_seed_port":    ratio(m(benchWAL, "events_per_s"), m(benchSeedPort, "events_per_s")),
		"wal_vs_polling":      ratio(m(benchWAL, "events_per_s"), m(benchPolling, "events_per_s")),
		"wal_vs_cdc":          ratio(m(benchWAL, "events_per_s"), m(benchCDC, "events_per_s")),
		"wal_writers_seconds": m(benchWAL, "writers_seconds"), "polling_writers_seconds": m(benchPolling, "writers_seconds"),
		"cdc_writers_seconds":  m(benchCDC, "writers_seconds"),
		"wal_writers_vs_table": ratio(m(benchWAL, "writers_seconds"), m(benchPolling, "writers_seconds")),
		"server":               srv.describe(), "load_average_before": load0, "load_average_after": loadAverage()}
	if srv.measured() {
		out["wal_server_cpu_us_per_event"] = m(benchWAL, "server_cpu_us_per_event")
		out["cdc_server_cpu_us_per_event"] = m(benchCDC, "server_cpu_us_per_event")
		out["polling_server_cpu_us_per_event"] = m(benchPolling, "server_cpu_us_per_event")
		out["wal_server_cpu_vs_polling"] = ratio(m(benchWAL, "server_cpu_us_per_event"), m(benchPolling, "server_cpu_us_per_event"))
	}
	emit(out)
	if latRate <= 0 {
		return nil
	}
	return env.latencyWAL(ctx, sides, rounds, latRate, int(float64(latRate)*latSeconds))
}

// latencyWAL runs the latency of each side, rounds rotating the order, and
// prints one line per side and round, then the medians side by side.
func (e *benchEnv) latencyWAL(ctx context.Context, sides []walSide, rounds, rate, n int) error {
	keys := []string{"p50_ms", "p99_ms", "broker_ack_p50_ms", "broker_ack_p99_ms", "consumer_handle_p50_ms", "consumer_handle_p99_ms"}
	lat := map[string]map[string][]float64{}
	for round := 1; round <= rounds; round++ {
		for i := range sides {
			side := sides[(i+round-1)%len(sides)]
			res, err := e.latencyMode(ctx, side.mode, "latency_"+strings.TrimPrefix(side.name, "relay_"), rate, n,
				func(ctx context.Context, names migrate.Names, topic string, picked func(id string), pub transport.Publisher) error {
					tr := pickedTransform(picked)
					if side.port {
						return runPort(ctx, e, names, topic, false)
					}
					rcfg := relay.Config{Pool: e.pool, Names: names, Publisher: pub, Topic: topic, Origin: "comandes", Logger: e.log, Transform: tr}
					if !side.cdc {
						r, err := relay.New(rcfg)
						if err != nil {
							return err
						}
						defer r.Close()
						return r.Run(ctx)
					}
					r, err := cdc.New(cdc.Config{Config: rcfg, WAL: side.mode == outbox.ModeWAL})
					if err != nil {
						return err
					}
					if side.mode == outbox.ModeTable {
						defer dropSlot(e, r) // the WAL mode's slot is latencyMode's
					}
					defer r.Close()
					return r.Run(ctx)
				})
			if err != nil {
				return fmt.Errorf("latency, round %d, %s: %w", round, side.name, err)
			}
			res["round"] = round
			emit(res)
			if lat[side.name] == nil {
				lat[side.name] = map[string][]float64{}
			}
			for _, k := range keys {
				if v, ok := res[k].(float64); ok {
					lat[side.name][k] = append(lat[side.name][k], v)
				}
			}
		}
	}
	sum := map[string]any{"bench": "latency_wal_vs_cdc_vs_polling", "rate": rate, "events": n, "rounds": rounds,
		"what": "commit → consumer commit (km0's consumer with its inbox, one transaction per batch, its own pool; the COMMIT that applied the event); " +
			"broker_ack: commit → the broker's confirmation to the relay; medians of the rounds",
		"load_average": loadAverage()}
	for _, side := range sides {
		name := strings.TrimPrefix(side.name, "relay_")
		for _, k := range keys {
			if v := lat[side.name][k]; len(v) > 0 { // the port reports no broker_ack
				sum[name+"_"+k] = med2(v)
			}
		}
	}
	sum["target_p50_met"] = sum["wal_p50_ms"].(float64) <= 1
	sum["target_p99_met"] = sum["wal_p99_ms"].(float64) <= 5
	emit(sum)
	return nil
}

// moveWritten runs one side: a fresh schema (and, for the WAL mode, its
// slot, before anything is written), the side's relay, then the live
// writers; it returns the result line once the topic holds n records.
func (e *benchEnv) moveWritten(ctx context.Context, side walSide, n, aggs int, srv *serverMeter) (map[string]any, error) {
	s, err := newBenchSchema(ctx, e.pool, migrate.Outbox)
	if err != nil {
		return nil, err
	}
	defer s.drop()
	topic := "bench." + s.Names.Schema
	dropTopic, err := e.topic(ctx, topic)
	if err != nil {
		return nil, err
	}
	defer dropTopic()
	ob := outbox.New(outbox.Config{Names: s.Names, Mode: side.mode})
	rcfg := relay.Config{Pool: e.pool, Names: s.Names, Publisher: kafka.NewPublisher(e.cl), Topic: topic, Origin: "comandes", Logger: e.log}
	var stop func() error
	switch {
	case side.port:
		stop = background(ctx, func(ctx context.Context) error { return runPort(ctx, e, s.Names, topic, false) }, func() {})
	case side.cdc:
		r, err := cdc.New(cdc.Config{Config: rcfg, WAL: side.mode == outbox.ModeWAL})
		if err != nil {
			return nil, err
		}
		if side.mode == outbox.ModeWAL {
			if _, err := migrate.EnsureWALSlot(ctx, e.pool, r.Slot(), r.Publication()); err != nil {
				r.Close()
				return nil, err
			}
		}
		stop = background(ctx, r.Run, func() { r.Close(); dropSlot(e, r) })
		// Timed from the first write on, in the steady state: the slot
		// held, as the polling relay is from its start.
		for deadline := time.Now().Add(time.Minute); !r.Active(); {
			if time.Now().After(deadline) {
				return nil, errors.New("the CDC relay did not hold its slot within a minute")
			}
			time.Sleep(5 * time.Millisecond) // polling the relay's start with a deadline
		}
	default:
		r, err := relay.New(rcfg)
		if err != nil {
			return nil, err
		}
		stop = background(ctx, r.Run, r.Close)
	}
	defer func() { _ = stop() }()
	m := startMeter()
	srv.start()
	t0 := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, walBenchWriters)
	for w := range walBenchWriters {
		share := n / walBenchWriters
		if w == walBenchWriters-1 {
			share = n - share*(walBenchWriters-1)
		}
		wg.Go(func() { errs[w] = writeLive(ctx, e.pool, ob, w*(n/walBenchWriters), share, aggs) })
	}
	wg.Wait()
	writers := time.Since(t0)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("live writers: %w", err)
	}
	var recs int64
	for deadline := time.Now().Add(5 * time.Minute); ; {
		if recs, err = e.records(ctx, topic); err != nil {
			return nil, err
		}
		if recs >= int64(n) {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%d of %d records on the topic after 5 minutes", recs, n)
		}
		time.Sleep(5 * time.Millisecond) // polling the outcome, not waiting for work
	}
	elapsed, cpu, rss := m.stop()
	srvCPU, byProc := srv.stop(ctx)
	if err := stop(); err != nil {
		return nil, fmt.Errorf("%s: %w", side.name, err)
	}
	var rows, bytes int64
	if err := e.pool.QueryRow(ctx, "SELECT count(*), pg_total_relation_size($1::text::regclass) FROM "+
		pgx.Identifier{s.Names.Schema, s.Names.Outbox}.Sanitize(), pgx.Identifier{s.Names.Schema, s.Names.Outbox}.Sanitize()).Scan(&rows, &bytes); err != nil {
		return nil, err
	}
	res := map[string]any{"bench": side.name, "outbox_mode": string(side.mode), "events": n, "records": recs,
		"seconds": round2(elapsed.Seconds()), "events_per_s": round2(float64(n) / elapsed.Seconds()),
		"writers_seconds": round2(writers.Seconds()), "rss_mb": round2(rss),
		"cpu_us_per_event": round2(float64(cpu.Microseconds()) / float64(n)), "outbox_rows": rows, "outbox_bytes": bytes}
	srv.put(res, srvCPU, byProc, n)
	return res, nil
}

// writeLive writes count events from event number from, walBenchTx a
// transaction, on aggs aggregates, with ob (either mode).
func writeLive(ctx context.Context, pool *pgxpool.Pool, ob *outbox.Outbox, from, count, aggs int) error {
	for done := 0; done < count; {
		c := min(walBenchTx, count-done)
		events := make([]*outbox.Event, c)
		for i := range events {
			k := from + done + i
			events[i] = &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-2026-%06d", k%aggs),
				Type: "comanda.creada", Payload: benchPayload(k)}
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.EnqueueBatch(ctx, tx, events) }); err != nil {
			return err
		}
		done += c
	}
	return nil
}
