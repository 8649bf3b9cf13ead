package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// The relays of `km0 bench relay --mode cdc`.
const (
	benchCDC     = "relay_cdc"
	benchPolling = "relay_polling"
)

// logicalServer returns the URL of a server with wal_level = logical:
// dbURL's when it is one, else a private cluster's that the caller stops
// (c non-nil).
func logicalServer(ctx context.Context, dbURL string) (url string, c *pgcluster.Cluster, err error) {
	pool, err := cli.OpenPool(ctx, dbURL, 1)
	if err != nil {
		return "", nil, err
	}
	var level string
	err = pool.QueryRow(ctx, "SHOW wal_level").Scan(&level)
	pool.Close()
	if err != nil {
		return "", nil, err
	}
	if level == "logical" {
		return dbURL, nil, nil
	}
	if c, err = pgcluster.Start(pgcluster.Options{}); err != nil {
		return "", nil, fmt.Errorf("the server has wal_level = %s and a private cluster with wal_level = logical did not start: %w", level, err)
	}
	return c.URL, c, nil
}

// benchRelayCDC is `km0 bench relay --mode cdc`: km0 relay --mode cdc and
// km0 relay (polling, its defaults) in the same run, alternating round by
// round, each on a fresh schema with n/2 rows pre-inserted and n/2 written
// live (4 writers, 500 rows a transaction) while it runs; then, with
// latRate > 0, the commit → consumer commit latency of each at latRate
// events/s. One JSON line per round and relay, and a side-by-side line.
func benchRelayCDC(ctx context.Context, dbURL, brokers string, n, aggs, rounds, batch, workers, latRate int, latSeconds float64, del bool) error {
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
	starts := map[string]func(ctx context.Context, names migrate.Names, topic string) (func() error, error){
		benchPolling: func(ctx context.Context, names migrate.Names, topic string) (func() error, error) {
			r, err := relay.New(relay.Config{Pool: env.pool, Names: names, Publisher: kafka.NewPublisher(env.cl),
				Topic: topic, Origin: "comandes", BatchSize: batch, Workers: workers, Logger: env.log, DeletePublished: del})
			if err != nil {
				return nil, err
			}
			return background(ctx, r.Run, func() { r.Close() }), nil
		},
		benchCDC: func(ctx context.Context, names migrate.Names, topic string) (func() error, error) {
			r, err := newBenchCDC(env, names, topic, kafka.NewPublisher(env.cl), nil, del)
			if err != nil {
				return nil, err
			}
			return background(ctx, r.Run, func() { r.Close(); dropSlot(env, r) }), nil
		},
	}
	rates, cpus, srvs := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	var ratios []float64
	for round := 1; round <= rounds; round++ {
		order := []string{benchCDC, benchPolling}
		if round%2 == 0 {
			order = []string{benchPolling, benchCDC}
		}
		got := map[string]float64{}
		for _, side := range order {
			res, err := env.moveLive(ctx, side, n, aggs, starts[side], srv)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round, side, err)
			}
			res["round"] = round
			emit(res)
			got[side] = res["events_per_s"].(float64)
			rates[side] = append(rates[side], got[side])
			cpus[side] = append(cpus[side], res["cpu_us_per_event"].(float64))
			if v, ok := res["server_cpu_us_per_event"].(float64); ok {
				srvs[side] = append(srvs[side], v)
			}
		}
		ratios = append(ratios, ratio(got[benchCDC], got[benchPolling]))
	}
	cdcRate, pollRate := med2(rates[benchCDC]), med2(rates[benchPolling])
	out := map[string]any{"bench": "relay_cdc_vs_polling",
		"what":   "km0 relay --mode cdc beside km0 relay (polling, defaults) in one run, rounds alternating; half the rows pre-inserted, half written live; cpu_us_per_event is this process (relay, writers, " + brokerKind(env) + "), server_cpu_us_per_event the PostgreSQL server's",
		"events": n, "rounds": rounds, "cdc_events_per_s": cdcRate, "polling_events_per_s": pollRate,
		"cdc_vs_polling": ratios, "median_cdc_vs_polling": med2(ratios),
		"cdc_cpu_us_per_event": med2(cpus[benchCDC]), "polling_cpu_us_per_event": med2(cpus[benchPolling]),
		"load_average_before": load0, "load_average_after": loadAverage(),
		"target_90k_met": cdcRate >= 90_000, "target_1_3x_met": med2(ratios) >= 1.3, "delete_published": del}
	if srv.measured() {
		out["cdc_server_cpu_us_per_event"], out["polling_server_cpu_us_per_event"] = med2(srvs[benchCDC]), med2(srvs[benchPolling])
	} else {
		out["cdc_server_cpu_us_per_event"], out["polling_server_cpu_us_per_event"] = nil, nil
	}
	out["server"] = srv.describe()
	emit(out)
	if latRate <= 0 {
		return nil
	}
	ln := int(float64(latRate) * latSeconds)
	// The same rounds, alternating the order too.
	lat := map[string]map[string][]float64{benchCDC: {}, benchPolling: {}}
	keys := []string{"p50_ms", "p99_ms", "broker_ack_p50_ms", "broker_ack_p99_ms"}
	for round := 1; round <= rounds; round++ {
		order := []string{benchPolling, benchCDC}
		if round%2 == 0 {
			order = []string{benchCDC, benchPolling}
		}
		for _, side := range order {
			res, err := env.latency(ctx, "latency_"+strings.TrimPrefix(side, "relay_"), latRate, ln,
				func(ctx context.Context, names migrate.Names, topic string, picked func(id string), pub transport.Publisher) error {
					tr := pickedTransform(picked)
					if side == benchPolling {
						r, err := relay.New(relay.Config{Pool: env.pool, Names: names, Publisher: pub,
							Topic: topic, Origin: "comandes", Workers: workers, Logger: env.log, Transform: tr, DeletePublished: del})
						if err != nil {
							return err
						}
						defer r.Close()
						return r.Run(ctx)
					}
					r, err := newBenchCDC(env, names, topic, pub, tr, del)
					if err != nil {
						return err
					}
					defer dropSlot(env, r)
					defer r.Close()
					return r.Run(ctx)
				})
			if err != nil {
				return fmt.Errorf("latency, round %d, %s: %w", round, side, err)
			}
			res["round"] = round
			emit(res)
			for _, k := range keys {
				if v, ok := res[k].(float64); ok {
					lat[side][k] = append(lat[side][k], v)
				}
			}
		}
	}
	sum := map[string]any{"bench": "latency_cdc_vs_polling", "rate": latRate, "events": ln, "rounds": rounds,
		"what":         "commit → consumer commit (the consumer: Inbox.Process of each record in its own transaction, then the offset commit); broker_ack: commit → the broker's confirmation to the relay; medians of the rounds",
		"load_average": loadAverage()}
	for side, name := range map[string]string{benchCDC: "cdc", benchPolling: "polling"} {
		for _, k := range keys {
			sum[name+"_"+k] = med2(lat[side][k])
		}
	}
	sum["target_p50_met"] = sum["cdc_p50_ms"].(float64) <= 1
	sum["target_p99_met"] = sum["cdc_p99_ms"].(float64) <= 5
	emit(sum)
	return nil
}

// newBenchCDC is km0 relay --mode cdc's relay with its defaults on names.
func newBenchCDC(env *benchEnv, names migrate.Names, topic string, pub transport.Publisher, tr relay.Transform, del bool) (*cdc.Relay, error) {
	return cdc.New(cdc.Config{Config: relay.Config{Pool: env.pool, Names: names, Publisher: pub,
		Topic: topic, Origin: "comandes", Logger: env.log, Transform: tr, DeletePublished: del}})
}

// dropSlot removes the slot and publication of a stopped CDC relay (a slot
// keeps WAL for ever); its walsender may take a moment to leave.
func dropSlot(env *benchEnv, r *cdc.Relay) { dropSlotNamed(env, r.Slot(), r.Publication()) }

// dropSlotNamed is dropSlot by names.
func dropSlotNamed(env *benchEnv, slot, publication string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		_, err := env.pool.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1", slot)
		if err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond) // the walsender is exiting
	}
	if _, err := env.pool.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{publication}.Sanitize()); err != nil {
		fmt.Fprintf(os.Stderr, "km0 bench: drop publication: %v\n", err)
	}
}

// background runs run until the returned stop is called; stop returns its
// error (nil after a clean stop) and then runs after.
func background(ctx context.Context, run func(context.Context) error, after func()) func() error {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() {
			cancel()
			err = <-done
			after()
		})
		return err
	}
}

// moveLive fills a fresh schema with n/2 rows, starts a relay, writes n/2
// more while it runs and returns the result line once every row is marked
// published (and on the topic). serverCPU reads the server's CPU time (0 if
// unknown).
func (e *benchEnv) moveLive(ctx context.Context, bench string, n, aggs int,
	start func(ctx context.Context, names migrate.Names, topic string) (func() error, error), srv *serverMeter) (map[string]any, error) {
	s, err := newBenchSchema(ctx, e.pool, migrate.Outbox)
	if err != nil {
		return nil, err
	}
	defer s.drop()
	pre := n / 2
	if err := fill(ctx, e.pool, s.Names, pre, aggs); err != nil {
		return nil, fmt.Errorf("fill: %w", err)
	}
	topic := "bench." + s.Names.Schema
	dropTopic, err := e.topic(ctx, topic)
	if err != nil {
		return nil, err
	}
	defer dropTopic()
	m := startMeter()
	srv.start()
	stop, err := start(ctx, s.Names, topic)
	if err != nil {
		return nil, err
	}
	defer func() { _ = stop() }()
	live := n - pre
	const writers = 4
	var wg sync.WaitGroup
	errs := make([]error, writers)
	for w := range writers {
		share := live / writers
		if w == writers-1 {
			share = live - share*(writers-1)
		}
		wg.Go(func() { errs[w] = fillFrom(ctx, e.pool, s.Names, outbox.ModeTable, pre+w*(live/writers), share, 500) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("live writers: %w", err)
	}
	pending := "SELECT EXISTS (SELECT 1 FROM " + pgx.Identifier{s.Names.Schema, s.Names.Outbox}.Sanitize() + " WHERE publicat_en IS NULL)"
	for deadline := time.Now().Add(5 * time.Minute); ; {
		var left bool
		if err := e.pool.QueryRow(ctx, pending).Scan(&left); err != nil {
			return nil, err
		}
		if !left {
			break
		}
		if time.Now().After(deadline) {
			return nil, errors.New("rows still pending after 5 minutes")
		}
		time.Sleep(5 * time.Millisecond) // polling the outcome, not waiting for work
	}
	elapsed, cpu, rss := m.stop()
	srvCPU, byProc := srv.stop(ctx)
	if err := stop(); err != nil {
		return nil, fmt.Errorf("%s: %w", bench, err)
	}
	recs, err := e.records(ctx, topic)
	if err != nil {
		return nil, err
	}
	if recs < int64(n) {
		return nil, fmt.Errorf("%s: topic holds %d records, want %d", bench, recs, n)
	}
	res := map[string]any{"bench": bench, "events": n, "pre_inserted": pre, "live": live, "records": recs,
		"seconds": round2(elapsed.Seconds()), "events_per_s": round2(float64(n) / elapsed.Seconds()), "rss_mb": round2(rss),
		"cpu_us_per_event": round2(float64(cpu.Microseconds()) / float64(n))}
	srv.put(res, srvCPU, byProc, n)
	return res, nil
}

// put adds the server's CPU per event to res: server_cpu_us_per_event and
// by process when measured, else null with the reason in server_cpu.
func (m *serverMeter) put(res map[string]any, cpu time.Duration, byProc map[string]time.Duration, n int) {
	if !m.measured() {
		res["server_cpu_us_per_event"] = nil
		res["server_cpu"] = m.describe()
		return
	}
	res["server_cpu_us_per_event"] = round2(float64(cpu.Microseconds()) / float64(n))
	per := map[string]float64{}
	for k, v := range byProc {
		per[k] = round2(float64(v.Microseconds()) / float64(n))
	}
	res["server_cpu_us_per_event_by_process"] = per
}

// serverMeter measures the server's CPU time over a run, in total and by
// kind of server process (walsender, the relay's sessions, the writers',
// background processes): the private cluster's, or a given server's when it
// runs on this machine (its postmaster found from a session's pid in
// /proc); nothing otherwise, and says so.
type serverMeter struct {
	c     *pgcluster.Cluster
	pm    int // the given server's postmaster, 0 if not on this machine
	pool  *pgxpool.Pool
	total time.Duration
	procs map[int]time.Duration
}

func newServerMeter(ctx context.Context, c *pgcluster.Cluster, pool *pgxpool.Pool) *serverMeter {
	m := &serverMeter{c: c, pool: pool}
	if c == nil {
		var pid int
		if pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid) == nil {
			m.pm = pgcluster.Postmaster(pid)
		}
	}
	return m
}

// measured reports whether the meter reads the server's CPU.
func (m *serverMeter) measured() bool { return m.c != nil || m.pm > 0 }

// describe names the server measured, or why it is not.
func (m *serverMeter) describe() string {
	switch {
	case m.c != nil:
		return "private cluster, wal_level = logical, fsync on"
	case m.pm > 0:
		return "--database-url's server, on this machine (CPU from /proc)"
	}
	return "not measured: --database-url's server is not on this machine (its processes are not in /proc)"
}

func (m *serverMeter) cpu() (time.Duration, map[int]time.Duration) {
	switch {
	case m.c != nil:
		return m.c.CPU(), m.c.ProcessCPU()
	case m.pm > 0:
		return pgcluster.ServerCPU(m.pm), pgcluster.ServerProcessCPU(m.pm)
	}
	return 0, nil
}

func (m *serverMeter) start() { m.total, m.procs = m.cpu() }

// stop returns the CPU time since start, and that of the processes alive
// now by kind.
func (m *serverMeter) stop(ctx context.Context) (time.Duration, map[string]time.Duration) {
	if !m.measured() {
		return 0, nil
	}
	total, procs := m.cpu()
	total -= m.total
	kinds := map[int]string{}
	rows, err := m.pool.Query(ctx, "SELECT pid, backend_type, coalesce(application_name, '') FROM pg_stat_activity")
	if err == nil {
		for rows.Next() {
			var pid int
			var typ, app string
			if rows.Scan(&pid, &typ, &app) == nil {
				kinds[pid] = strings.TrimSpace(typ + " " + app)
			}
		}
		rows.Close()
	}
	by := map[string]time.Duration{}
	for pid, t := range procs {
		if d := t - m.procs[pid]; d > 0 {
			by[cmp.Or(kinds[pid], "other")] += d
		}
	}
	return total, by
}

// loadAverage is the 1-minute load average of /proc/loadavg ("" if unknown).
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}
