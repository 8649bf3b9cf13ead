package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport/kafka"
)

// The two sides of each part of `km0 bench system`.
const (
	sideKm0  = "km0"
	sidePort = "seed_port"
)

// sidesOf returns the order of the sides in round r (1-based): km0 first in
// odd rounds, the port first in even ones.
func sidesOf(r int) []string {
	if r%2 == 1 {
		return []string{sideKm0, sidePort}
	}
	return []string{sidePort, sideKm0}
}

// relay: n pre-inserted outbox rows (the contract's comanda.creada, one aggregate
// per order) moved by `km0 relay` with its defaults, then by the port of the
// reference polling relay, each as its own process against the same `km0 kafka`
// process, each on a fresh database and topic.
func (b *sysBench) relay(ctx context.Context, n, rounds int) error {
	k, err := b.startKafka(ctx)
	if err != nil {
		return err
	}
	defer k.stop()
	rates := map[string][]float64{}
	var ratios []float64
	var rss, cpu []float64
	for r := 1; r <= rounds; r++ {
		got := map[string]float64{}
		for _, side := range sidesOf(r) {
			res, err := b.relayRound(ctx, k, side, r, n)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", r, side, err)
			}
			emit(res)
			got[side] = res["events_per_s"].(float64)
			rates[side] = append(rates[side], got[side])
			if side == sideKm0 {
				rss, cpu = append(rss, res["rss_mb"].(float64)), append(cpu, res["cpu_s"].(float64))
			}
		}
		ratios = append(ratios, ratio(got[sideKm0], got[sidePort]))
		emit(map[string]any{"bench": "system_relay_round", "round": r, "events": n,
			"events_per_s": got[sideKm0], "seed_port_events_per_s": got[sidePort], "ratio": ratios[len(ratios)-1]})
	}
	emit(map[string]any{"bench": "system_relay", "what": "km0 relay (defaults) vs a Go port of the reference polling relay; broker = km0 kafka in another process",
		"events": n, "rounds": rounds, "events_per_s": med2(rates[sideKm0]), "seed_port_events_per_s": med2(rates[sidePort]),
		"ratios": ratios, "median_ratio": med2(ratios), "rss_mb": slices.Max(rss), "cpu_s": med2(cpu)})
	return nil
}

// relayRound fills a fresh database with n rows, runs one side's relay as a
// process until no row is pending, and checks every row is marked and the
// topic holds at least n records.
func (b *sysBench) relayRound(ctx context.Context, k *broker, side string, r, n int) (map[string]any, error) {
	name := b.dbName("relay", strconv.Itoa(r), side)
	dbURL, err := b.createDB(ctx, name)
	if err != nil {
		return nil, err
	}
	defer b.dropDB(name)
	pool, err := cli.OpenPool(ctx, dbURL, 2)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if err := svc.Migrate(ctx, pool, migrate.Outbox); err != nil {
		return nil, err
	}
	if err := fill(ctx, pool, migrate.Names{}.WithDefaults(), n, n); err != nil {
		return nil, fmt.Errorf("fill: %w", err)
	}
	topic := fmt.Sprintf("bench.relay.%s.%d.%s", b.tag, r, side)
	if err := kafka.EnsureTopics(ctx, k.cl, kafka.PartitionsDefault, topic); err != nil {
		return nil, err
	}
	defer func() { _, _ = k.admin.DeleteTopics(context.Background(), topic) }()
	// Only the required settings: a user's first run. The database URL goes
	// in the environment (KM0_DATABASE_URL), out of the process list.
	flags := []string{"--brokers", k.addr, "--topic", topic, "--origin", "comandes"}
	args, pname := append([]string{"relay"}, flags...), "km0 relay"
	if side == sidePort {
		args, pname = append([]string{"bench", "system", "_port-relay"}, flags...), "seed relay port"
	}
	p, err := b.spawn(pname, []string{"KM0_DATABASE_URL=" + dbURL}, args...)
	if err != nil {
		return nil, err
	}
	defer p.stop()
	var first time.Time // when a row was first seen marked
	err = b.waitUntil(ctx, pname+" to drain the outbox", p, 5*time.Millisecond, func(ctx context.Context) (bool, error) {
		if first.IsZero() {
			var some bool
			if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM outbox WHERE publicat_en IS NOT NULL)").Scan(&some); err != nil || !some {
				return false, err
			}
			first = time.Now()
		}
		var pending bool
		err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM outbox WHERE publicat_en IS NULL)").Scan(&pending)
		return err == nil && !pending, err
	})
	if err != nil {
		return nil, err
	}
	elapsed := time.Since(p.start)
	steady := elapsed - first.Sub(p.start)
	cpu, rss := procUsage(p)
	var published, pending int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE publicat_en IS NOT NULL), count(*) FILTER (WHERE publicat_en IS NULL) FROM outbox").
		Scan(&published, &pending); err != nil {
		return nil, err
	}
	recs, err := k.records(ctx, topic)
	if err != nil {
		return nil, err
	}
	if published != int64(n) || pending != 0 || recs < int64(n) {
		return nil, fmt.Errorf("%s: %d rows marked published, %d pending, %d records on the topic; want %d, 0, ≥ %d", pname, published, pending, recs, n, n)
	}
	return map[string]any{"bench": "system_relay", "side": side, "round": r, "events": n, "published": published, "records": recs,
		"seconds": round2(elapsed.Seconds()), "events_per_s": round2(float64(n) / elapsed.Seconds()),
		"startup_s": round2(first.Sub(p.start).Seconds()), "events_per_s_after_startup": perSecond(n, steady),
		"rss_mb": round2(rss), "cpu_s": round2(cpu.Seconds()), "cpu_us_per_event": round2(float64(cpu.Microseconds()) / float64(n))}, nil
}

// runPortRelayProcess is `km0 bench system _port-relay`: runPort (the
// straight port of the reference polling relay) as a process of its own, until SIGTERM.
func runPortRelayProcess(ctx context.Context, args []string) error {
	fs := cli.NewFlags("bench system _port-relay", "the reference polling relay loop, ported to Go (benchmark peer)")
	dbURL := cli.DatabaseURLFlag(fs)
	brokers := cli.BrokersFlag(fs)
	topic := fs.String("topic", "", "topic")
	fs.String("origin", "comandes", "ignored: the reference relay writes origen comandes")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *topic == "" {
		return errors.New("--topic is required")
	}
	bs, err := cli.RequireBrokers(*brokers)
	if err != nil {
		return err
	}
	pool, err := cli.OpenPool(ctx, *dbURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	cl, err := kafka.NewClient(bs)
	if err != nil {
		return err
	}
	defer cl.Close()
	return runPort(ctx, &benchEnv{pool: pool, cl: cl}, migrate.Names{}.WithDefaults(), *topic, false)
}
