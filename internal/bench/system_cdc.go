package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport/kafka"
)

// The sides of `km0 bench system --only relay-cdc`.
const (
	sideCDC     = "km0_cdc"
	sidePolling = "km0_polling"
	sideWAL     = "km0_wal" // km0 relay --outbox wal, the writers in outbox.ModeWAL
)

// relayCDC: `km0 relay --outbox wal` (the writers in WAL mode) and `km0
// relay --mode cdc` beside `km0 relay` (polling, its defaults) and the port
// of the seed's relay, each as its own process
// against the same `km0 kafka` process, on a private PostgreSQL cluster with
// wal_level = logical (fsync on) that the run starts and removes. Each round
// and side gets a fresh database: n/2 rows are pre-inserted, the relay is
// started, and n/2 more are written while it runs (4 writers, 500 rows a
// transaction); the time is from the relay's start until every row is
// marked (the WAL side: until the topic holds every event; its slot is
// created before the first write).
func (b *sysBench) relayCDC(ctx context.Context, n, rounds int) error {
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		return fmt.Errorf("a private PostgreSQL cluster with wal_level = logical: %w", err)
	}
	defer c.Stop()
	cb, err := newSysBench(ctx, c.URL, b.amqpURL, b.timeout)
	if err != nil {
		return err
	}
	defer cb.close()
	k, err := cb.startKafka(ctx)
	if err != nil {
		return err
	}
	defer k.stop()
	sides := []string{sideWAL, sideCDC, sidePolling, sidePort}
	rates := map[string][]float64{}
	cpu := map[string][]float64{}
	var vsPort, vsPolling, walVsPort, walVsPolling []float64
	for r := 1; r <= rounds; r++ {
		got := map[string]float64{}
		order := sides
		if r%2 == 0 {
			order = []string{sidePort, sidePolling, sideCDC, sideWAL}
		}
		for _, side := range order {
			res, err := cb.relayCDCRound(ctx, k, side, r, n)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", r, side, err)
			}
			emit(res)
			got[side] = res["events_per_s"].(float64)
			rates[side] = append(rates[side], got[side])
			cpu[side] = append(cpu[side], res["cpu_us_per_event"].(float64))
		}
		vsPort, vsPolling = append(vsPort, ratio(got[sideCDC], got[sidePort])), append(vsPolling, ratio(got[sideCDC], got[sidePolling]))
		walVsPort, walVsPolling = append(walVsPort, ratio(got[sideWAL], got[sidePort])), append(walVsPolling, ratio(got[sideWAL], got[sidePolling]))
		emit(map[string]any{"bench": "system_relay_cdc_round", "round": r, "events": n, "wal_events_per_s": got[sideWAL],
			"cdc_events_per_s": got[sideCDC], "polling_events_per_s": got[sidePolling], "seed_port_events_per_s": got[sidePort],
			"wal_vs_seed_port": walVsPort[len(walVsPort)-1], "wal_vs_polling": walVsPolling[len(walVsPolling)-1],
			"cdc_vs_seed_port": vsPort[len(vsPort)-1], "cdc_vs_polling": vsPolling[len(vsPolling)-1]})
	}
	emit(map[string]any{"bench": "system_relay_cdc",
		"what": "km0 relay --outbox wal (WAL-mode writers) and km0 relay --mode cdc vs km0 relay (polling, defaults) vs a Go port of the seed's relay; " +
			"half the events written before the relay starts, half live; broker = km0 kafka in another process; private logical cluster",
		"events": n, "rounds": rounds, "wal_events_per_s": med2(rates[sideWAL]), "wal_vs_seed_port": walVsPort, "median_wal_vs_seed_port": med2(walVsPort),
		"wal_vs_polling": walVsPolling, "median_wal_vs_polling": med2(walVsPolling), "wal_cpu_us_per_event": med2(cpu[sideWAL]),
		"cdc_events_per_s": med2(rates[sideCDC]), "polling_events_per_s": med2(rates[sidePolling]),
		"seed_port_events_per_s": med2(rates[sidePort]), "cdc_vs_seed_port": vsPort, "median_cdc_vs_seed_port": med2(vsPort),
		"cdc_vs_polling": vsPolling, "median_cdc_vs_polling": med2(vsPolling),
		"cdc_cpu_us_per_event": med2(cpu[sideCDC]), "polling_cpu_us_per_event": med2(cpu[sidePolling])})
	return nil
}

// relayCDCRound runs one side once on a fresh database of the private
// cluster and checks that every row is marked and on the topic.
func (b *sysBench) relayCDCRound(ctx context.Context, k *broker, side string, r, n int) (map[string]any, error) {
	name := b.dbName("cdc", strconv.Itoa(r), side)
	dbURL, err := b.createDB(ctx, name)
	if err != nil {
		return nil, err
	}
	defer b.dropDB(name)
	pool, err := cli.OpenPool(ctx, dbURL, 6)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	// A slot keeps its database from being dropped: drop it first, once the
	// stopped relay's session has gone.
	defer func() {
		for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
			if _, err := pool.Exec(context.Background(), "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database()"); err == nil {
				return
			}
		}
	}()
	if err := svc.Migrate(ctx, pool, migrate.Outbox); err != nil {
		return nil, err
	}
	names := migrate.Names{}.WithDefaults()
	mode := outbox.ModeTable
	if side == sideWAL {
		// The slot before anything is written, as km0 migrate --outbox-mode wal.
		slot := migrate.WALSlot(name, names)
		if _, err := migrate.EnsureWALSlot(ctx, pool, slot, slot); err != nil {
			return nil, err
		}
		defer func() {
			_, _ = pool.Exec(context.Background(), "DROP PUBLICATION IF EXISTS "+pgx.Identifier{slot}.Sanitize())
		}()
		mode = outbox.ModeWAL
	}
	pre := n / 2
	var fillErr error
	if mode == outbox.ModeWAL {
		fillErr = fillFrom(ctx, pool, names, mode, 0, pre, 5000)
	} else {
		fillErr = fill(ctx, pool, names, pre, pre)
	}
	if fillErr != nil {
		return nil, fmt.Errorf("fill: %w", fillErr)
	}
	topic := fmt.Sprintf("bench.relaycdc.%s.%d.%s", b.tag, r, side)
	if err := kafka.EnsureTopics(ctx, k.cl, kafka.PartitionsDefault, topic); err != nil {
		return nil, err
	}
	defer func() { _, _ = k.admin.DeleteTopics(context.Background(), topic) }()
	flags := []string{"--brokers", k.addr, "--topic", topic, "--origin", "comandes"}
	var args []string
	pname := side
	switch side {
	case sideWAL:
		args = append(append([]string{"relay"}, flags...), "--outbox", "wal")
	case sideCDC:
		args = append(append([]string{"relay"}, flags...), "--mode", "cdc")
	case sidePolling:
		args = append([]string{"relay"}, flags...)
	default:
		args = append([]string{"bench", "system", "_port-relay"}, flags...)
	}
	p, err := b.spawn(pname, []string{"KM0_DATABASE_URL=" + dbURL}, args...)
	if err != nil {
		return nil, err
	}
	defer p.stop()
	// The live half: 4 writers, 500 rows a transaction, while the relay runs.
	var wg sync.WaitGroup
	var writeErr error
	var mu sync.Mutex
	live := n - pre
	t0 := time.Now()
	var writeDur time.Duration
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	const writers = 4
	for w := range writers {
		wg.Go(func() {
			share := live / writers
			if w == writers-1 {
				share = live - share*(writers-1)
			}
			if err := fillFrom(wctx, pool, names, mode, pre+w*(live/writers), share, 500); err != nil {
				mu.Lock()
				writeErr = errors.Join(writeErr, err)
				mu.Unlock()
			}
		})
	}
	go func() {
		wg.Wait()
		mu.Lock()
		writeDur = time.Since(t0)
		mu.Unlock()
	}()
	err = b.waitUntil(ctx, pname+" to drain the outbox", p, 5*time.Millisecond, func(ctx context.Context) (bool, error) {
		mu.Lock()
		done, werr := writeDur > 0, writeErr
		mu.Unlock()
		if werr != nil {
			return false, werr
		}
		if !done {
			return false, nil
		}
		if mode == outbox.ModeWAL {
			recs, err := k.records(ctx, topic)
			return err == nil && recs >= int64(n), err
		}
		var pending bool
		err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM outbox WHERE publicat_en IS NULL)").Scan(&pending)
		return err == nil && !pending, err
	})
	if err != nil {
		return nil, err
	}
	elapsed := time.Since(p.start)
	cpuT, rss := procUsage(p)
	var published, pending int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE publicat_en IS NOT NULL), count(*) FILTER (WHERE publicat_en IS NULL) FROM outbox").
		Scan(&published, &pending); err != nil {
		return nil, err
	}
	recs, err := k.records(ctx, topic)
	if err != nil {
		return nil, err
	}
	if mode == outbox.ModeWAL {
		if published+pending != 0 || recs < int64(n) {
			return nil, fmt.Errorf("%s: %d outbox rows, %d records on the topic; want 0 and ≥ %d", pname, published+pending, recs, n)
		}
	} else if published != int64(n) || pending != 0 || recs < int64(n) {
		return nil, fmt.Errorf("%s: %d rows marked published, %d pending, %d records on the topic; want %d, 0, ≥ %d", pname, published, pending, recs, n, n)
	}
	mu.Lock()
	wd := writeDur
	mu.Unlock()
	return map[string]any{"bench": "system_relay_cdc", "side": side, "round": r, "events": n, "pre_inserted": pre, "live": live,
		"records": recs, "seconds": round2(elapsed.Seconds()), "events_per_s": round2(float64(n) / elapsed.Seconds()),
		"live_write_s": round2(wd.Seconds()), "rss_mb": round2(rss), "cpu_s": round2(cpuT.Seconds()),
		"cpu_us_per_event": round2(float64(cpuT.Microseconds()) / float64(n))}, nil
}

// fillFrom writes count events numbered from..from+count-1 (one aggregate
// each, as fill) to the outbox in mode, chunk events a transaction.
func fillFrom(ctx context.Context, pool *pgxpool.Pool, names migrate.Names, mode outbox.Mode, from, count, chunk int) error {
	ob := outbox.New(outbox.Config{Names: names, Mode: mode})
	for done := 0; done < count; {
		c := min(chunk, count-done)
		events := make([]*outbox.Event, c)
		for i := range events {
			k := from + done + i
			events[i] = &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprintf("P-2026-%06d", k),
				Type: "comanda.creada", Payload: benchPayload(k)}
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.EnqueueBatch(ctx, tx, events) }); err != nil {
			return err
		}
		done += c
	}
	return nil
}
