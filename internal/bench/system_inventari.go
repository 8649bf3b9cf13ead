package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/schema"
)

// The contract's five products, in a fixed order.
var benchProducts = []string{"tomaquet-rosa", "carbasso", "formatge-curat", "formatge-fresc", "vi-crianca"}

var benchPrices = map[string]int{"tomaquet-rosa": 320, "carbasso": 250, "formatge-curat": 1450, "formatge-fresc": 890, "vi-crianca": 1275}

// benchOrder is one comanda.creada of the inventari workload.
type benchOrder struct {
	eventID string
	lines   []inventari.Line
}

// benchOrders makes n comanda.creada envelopes (v2, valid per
// schemas/comanda.creada) over the five products, 1–2 lines each of 1–3
// units, keyed by the order id; and the units asked of each product.
func benchOrders(n int, seed uint64, reg *schema.Registry) (map[string]benchOrder, []*kgo.Record, map[string]int, error) {
	rng := rand.New(rand.NewPCG(seed, 0x6b6d30))
	orders := make(map[string]benchOrder, n)
	recs := make([]*kgo.Record, 0, n)
	demand := map[string]int{}
	now := time.Now().UnixMilli()
	type line struct {
		Product  string `json:"producte"`
		Quantity int    `json:"quantitat"`
		Price    int    `json:"preu_centims"`
	}
	for i := range n {
		id := fmt.Sprintf("P-2026-%06d", i)
		perm := rng.Perm(len(benchProducts))
		var lines []line
		var ls []inventari.Line
		for _, j := range perm[:1+rng.IntN(2)] {
			p, q := benchProducts[j], 1+rng.IntN(3)
			lines = append(lines, line{p, q, benchPrices[p]})
			ls = append(ls, inventari.Line{Product: p, Quantity: q})
			demand[p] += q
		}
		dades, _ := json.Marshal(map[string]any{"id": id, "client": "anna", "mercat": "girona", "linies": lines,
			"adreca_lliurament": map[string]string{"ciutat": "Girona", "codi_postal": "17001"}})
		if err := reg.Validate(comandes.TypeCreated, 2, dades); err != nil {
			return nil, nil, nil, err
		}
		ev := uuid.NewString()
		value, _ := json.Marshal(portEnvelope{ID: ev, Type: comandes.TypeCreated, Version: 2, TimeMS: now, Origin: comandes.Name, Data: dades})
		recs = append(recs, &kgo.Record{Topic: comandes.Topic, Key: []byte(id), Value: value, Headers: []kgo.RecordHeader{
			{Key: "tipus", Value: []byte(comandes.TypeCreated)}, {Key: "id_esdeveniment", Value: []byte(ev)}}})
		orders[ev] = benchOrder{eventID: ev, lines: ls}
	}
	return orders, recs, demand, nil
}

// serviceDatabaseFlag says whether `km0 serve` of this binary accepts a
// service's own database URL (--service-database-url); without it, the
// service uses km0_<service> on the server of --database-url.
func (b *sysBench) serviceDatabaseFlag() bool {
	b.flagOnce.Do(func() {
		out, _ := exec.Command(b.exe, "serve", "inventari", "--help").CombinedOutput()
		b.serviceFlag = strings.Contains(string(out), "service-database-url")
	})
	return b.serviceFlag
}

// serviceEnv is the environment of a `km0 serve` process: the admin URL in
// KM0_DATABASE_URL (out of the process list), and no service database of
// the caller's environment.
func (b *sysBench) serviceEnv() []string {
	return []string{"KM0_DATABASE_URL=" + b.admin, "KM0_INVENTARI_DATABASE_URL=", "KM0_PAGAMENTS_DATABASE_URL=", "KM0_AMQP_URL=" + b.amqpURL}
}

// serviceDB creates the fresh database km0's service will use and returns
// its URL and the extra flags of `km0 serve` that point the service at it.
// TODO(lead): once --service-database-url (KM0_<SERVICE>_DATABASE_URL) is in
// every binary, drop the km0_<service> fallback below.
func (b *sysBench) serviceDB(ctx context.Context, service, round string) (name, dbURL string, flags []string, err error) {
	if b.serviceDatabaseFlag() {
		name = b.dbName(service, round, sideKm0)
		dbURL, err = b.createDB(ctx, name)
		return name, dbURL, []string{"--service-database-url", dbURL}, err
	}
	// Today's `km0 serve NAME` uses km0_<service> on the admin URL's server,
	// created if absent. The benchmark creates it (it must not exist: it may
	// be someone's) and drops it afterwards.
	name = svc.DatabaseName(service, "")
	dbURL, err = b.createDB(ctx, name)
	if err != nil {
		err = fmt.Errorf("%w (km0 serve %s of this binary always uses %s: drop it, or stop whatever uses it, and run again)", err, service, name)
	}
	return name, dbURL, nil, err
}

// inventari: n comanda.creada on a fresh `km0 kafka` process each round,
// consumed by `km0 serve inventari` with its defaults and by a port of the
// reference idempotent consumer, each on its own fresh database and group.
func (b *sysBench) inventari(ctx context.Context, n, rounds int, cheeseRunsOut, portOutbox bool) error {
	reg, err := schema.Default()
	if err != nil {
		return err
	}
	rates := map[string][]float64{}
	var ratios, rss []float64
	var deadlocks int64
	exact, dups := true, int64(0)
	for r := 1; r <= rounds; r++ {
		orders, recs, demand, err := benchOrders(n, uint64(r), reg)
		if err != nil {
			return err
		}
		restock := map[string]int{}
		for _, p := range benchProducts {
			if !cheeseRunsOut || !strings.HasPrefix(p, "formatge-") {
				restock[p] = demand[p]
			}
		}
		k, err := b.startKafka(ctx)
		if err != nil {
			return err
		}
		if err := k.cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			k.stop()
			return fmt.Errorf("produce the orders: %w", err)
		}
		got := map[string]float64{}
		for _, side := range sidesOf(r) {
			res, err := b.inventariRound(ctx, k, side, r, orders, restock, portOutbox)
			if err != nil {
				k.stop()
				return fmt.Errorf("round %d, %s: %w", r, side, err)
			}
			emit(res)
			got[side] = res["events_per_s"].(float64)
			rates[side] = append(rates[side], got[side])
			exact = exact && res["stock_exact"].(bool)
			dups += res["duplicates"].(int64)
			if side == sideKm0 {
				rss = append(rss, res["rss_mb"].(float64))
				deadlocks += res["deadlocks"].(int64)
			}
		}
		k.stop()
		ratios = append(ratios, ratio(got[sideKm0], got[sidePort]))
		emit(map[string]any{"bench": "system_inventari_round", "round": r, "events": n,
			"events_per_s": got[sideKm0], "seed_port_events_per_s": got[sidePort], "ratio": ratios[len(ratios)-1]})
	}
	emit(map[string]any{"bench": "system_inventari", "what": "km0 serve inventari (defaults) vs a Go port of the reference idempotent consumer; five hot products",
		"events": n, "rounds": rounds, "events_per_s": med2(rates[sideKm0]), "seed_port_events_per_s": med2(rates[sidePort]),
		"ratios": ratios, "median_ratio": med2(ratios), "rss_mb": round2(slices.Max(rss)), "deadlocks": deadlocks,
		"stock_exact": exact, "duplicates": dups, "port_outbox": portOutbox, "cheese_runs_out": cheeseRunsOut})
	return nil
}

// inventariSide is what one side's run is checked against.
type inventariSide struct {
	group, dlq string
	topics     []string // whose lag the group must bring to 0
}

// inventariRound runs one side on a fresh database over the records already
// on k, until its group has committed them all and every order is either
// applied or refused, then checks the stock to the unit.
func (b *sysBench) inventariRound(ctx context.Context, k *broker, side string, r int, orders map[string]benchOrder,
	restock map[string]int, portOutbox bool) (map[string]any, error) {
	n := len(orders)
	var (
		name, dbURL string
		extra       []string
		err         error
		s           inventariSide
	)
	if side == sideKm0 {
		name, dbURL, extra, err = b.serviceDB(ctx, inventari.Name, strconv.Itoa(r))
		s = inventariSide{group: inventari.ConsumerDecrement, dlq: comandes.Topic + contract.DLQSuffix,
			topics: []string{comandes.Topic, comandes.Topic + contract.RetrySuffix}}
	} else {
		name = b.dbName(inventari.Name, strconv.Itoa(r), sidePort)
		dbURL, err = b.createDB(ctx, name)
		s = inventariSide{group: "bench.port." + b.tag + "." + strconv.Itoa(r), dlq: "bench.port." + b.tag + ".dlq", topics: []string{comandes.Topic}}
	}
	if err != nil {
		return nil, err
	}
	defer b.dropDB(name)
	pool, err := cli.OpenPool(ctx, dbURL, 2)
	if err != nil {
		return nil, err
	}
	poolOpen := true
	defer func() {
		if poolOpen {
			pool.Close()
		}
	}()
	// The same schema on both sides (estoc seeded as the contract says), then
	// the restock.
	if err := svc.Migrate(ctx, pool, migrate.Outbox, migrate.Inbox, inventari.Migrations); err != nil {
		return nil, err
	}
	for p, q := range restock {
		if _, err := pool.Exec(ctx, "UPDATE estoc SET unitats = unitats + $1 WHERE producte = $2", q, p); err != nil {
			return nil, err
		}
	}
	start, err := readStock(ctx, pool)
	if err != nil {
		return nil, err
	}
	deadlocks0, err := b.deadlocks(ctx, name, false)
	if err != nil {
		return nil, err
	}
	var args []string
	env := b.serviceEnv()
	pname := "km0 serve inventari"
	if side == sideKm0 {
		args = append([]string{"serve", inventari.Name, "--brokers", k.addr}, extra...)
	} else {
		pname = "seed consumer port"
		env = []string{"KM0_DATABASE_URL=" + dbURL}
		args = []string{"bench", "system", "_port-inventari", "--brokers", k.addr,
			"--group", s.group, "--dlq-topic", s.dlq, "--outbox=" + strconv.FormatBool(portOutbox)}
	}
	p, err := b.spawn(pname, env, args...)
	if err != nil {
		return nil, err
	}
	defer p.stop()
	var applied, refused int64
	var first time.Time // when a key was first seen committed
	err = b.waitUntil(ctx, pname+" to consume every order", p, 20*time.Millisecond, func(ctx context.Context) (bool, error) {
		if first.IsZero() {
			var some bool
			if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM missatges_processats)").Scan(&some); err != nil {
				return false, err
			}
			if some {
				first = time.Now()
			}
		}
		lag, err := k.lag(ctx, s.group, s.topics...)
		if err != nil || lag > 0 {
			return false, nil // the group may not exist yet
		}
		if refused, err = k.records(ctx, s.dlq); err != nil {
			refused = 0 // no dead letter yet: the topic may not exist
		}
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM missatges_processats WHERE consumidor = $1", inventari.ConsumerDecrement).Scan(&applied); err != nil {
			return false, err
		}
		return applied+refused >= int64(n), nil
	})
	if err != nil {
		return nil, err
	}
	elapsed := time.Since(p.start)
	if first.IsZero() { // every order was refused
		first = time.Now()
	}
	steady := elapsed - first.Sub(p.start)
	cpu, rss := procUsage(p)
	check, err := checkStock(ctx, pool, orders, start, side == sideKm0 || portOutbox)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", pname, err)
	}
	if applied+refused != int64(n) {
		return nil, fmt.Errorf("%s: %d orders applied and %d refused (dead-lettered) of %d", pname, applied, refused, n)
	}
	pool.Close()
	poolOpen = false
	deadlocks1, err := b.deadlocks(ctx, name, true)
	if err != nil {
		return nil, err
	}
	res := map[string]any{"bench": "system_inventari", "side": side, "round": r, "events": n, "applied": applied, "refused": refused,
		"seconds": round2(elapsed.Seconds()), "events_per_s": round2(float64(n) / elapsed.Seconds()), "rss_mb": round2(rss),
		"startup_s": round2(first.Sub(p.start).Seconds()), "events_per_s_after_startup": perSecond(n, steady),
		"cpu_s": round2(cpu.Seconds()), "cpu_us_per_event": round2(float64(cpu.Microseconds()) / float64(n)),
		"deadlocks": deadlocks1 - deadlocks0, "stock_exact": check.exact, "duplicates": check.duplicates}
	if !check.exact {
		res["stock"], res["expected_stock"] = check.stock, check.expected
	}
	return res, nil
}

// deadlocks returns pg_stat_database.deadlocks of database name; with
// settled, once no session is connected to it (a backend flushes its
// statistics when it exits).
func (b *sysBench) deadlocks(ctx context.Context, name string, settled bool) (int64, error) {
	conn, err := pgx.Connect(ctx, b.admin)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if settled {
		err = b.waitUntil(ctx, "the sessions of "+name+" to end", nil, 20*time.Millisecond, func(ctx context.Context) (bool, error) {
			var sessions int
			err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", name).Scan(&sessions)
			return err == nil && sessions == 0, err
		})
		if err != nil {
			return 0, err
		}
	}
	var d int64
	err = conn.QueryRow(ctx, "SELECT coalesce((SELECT deadlocks FROM pg_stat_database WHERE datname = $1), 0)", name).Scan(&d)
	return d, err
}

func readStock(ctx context.Context, pool *pgxpool.Pool) (map[string]int, error) {
	rows, err := pool.Query(ctx, "SELECT producte, unitats FROM estoc")
	if err != nil {
		return nil, err
	}
	st := map[string]int{}
	var (
		p string
		u int
	)
	_, err = pgx.ForEachRow(rows, []any{&p, &u}, func() error { st[p] = u; return nil })
	return st, err
}

type stockCheck struct {
	exact           bool
	duplicates      int64
	stock, expected map[string]int
}

// checkStock compares the final stock with start minus the lines of every
// order whose key is in missatges_processats, and, with events, with the
// estoc.actualitzat rows of the outbox (one per order and product: a second
// one is a duplicate effect).
func checkStock(ctx context.Context, pool *pgxpool.Pool, orders map[string]benchOrder, start map[string]int, events bool) (stockCheck, error) {
	rows, err := pool.Query(ctx, "SELECT id_missatge FROM missatges_processats WHERE consumidor = $1", inventari.ConsumerDecrement)
	if err != nil {
		return stockCheck{}, err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return stockCheck{}, err
	}
	expected := map[string]int{}
	for p, u := range start {
		expected[p] = u
	}
	for _, id := range ids {
		o, ok := orders[id]
		if !ok {
			return stockCheck{}, fmt.Errorf("missatges_processats holds %q, an event the benchmark did not send", id)
		}
		for _, l := range o.lines {
			expected[l.Product] -= l.Quantity
		}
	}
	stock, err := readStock(ctx, pool)
	if err != nil {
		return stockCheck{}, err
	}
	c := stockCheck{exact: len(stock) == len(expected), stock: stock, expected: expected}
	for p, u := range expected {
		c.exact = c.exact && stock[p] == u
	}
	if !events {
		return c, nil
	}
	// Each applied line wrote one estoc.actualitzat (motiu comanda) whose
	// abans − despres is its quantity.
	var rowsN, distinct int64
	err = pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT (carrega->>'comanda_id', agregat_id))
		FROM outbox WHERE tipus = 'estoc.actualitzat' AND carrega->>'motiu' = 'comanda'`).Scan(&rowsN, &distinct)
	if err != nil {
		return c, err
	}
	c.duplicates = rowsN - distinct
	rows, err = pool.Query(ctx, `SELECT agregat_id, sum((carrega->>'abans')::int - (carrega->>'despres')::int)
		FROM outbox WHERE tipus = 'estoc.actualitzat' AND carrega->>'motiu' = 'comanda' GROUP BY agregat_id`)
	if err != nil {
		return c, err
	}
	var (
		p string
		t int
	)
	_, err = pgx.ForEachRow(rows, []any{&p, &t}, func() error {
		if start[p]-t != expected[p] {
			c.exact = false
		}
		return nil
	})
	return c, err
}

// runPortInventariProcess is `km0 bench system _port-inventari`: a straight
// Go port of the reference idempotent consumer, consumidor_idempotent.py, franz-go in
// place of confluent-kafka and pgx in place of psycopg: one connection, one
// message at a time, one transaction each (INSERT the key ON CONFLICT DO
// NOTHING RETURNING; a duplicate does nothing; UPDATE estoc ... WHERE unitats
// >= q per line; a line without stock rolls back, key included), then the
// offset commit (asynchronous, as confluent-kafka's commit(message=msg)).
// With --outbox it also writes one estoc.actualitzat per line into its
// outbox in the same transaction (transactional outbox). The reference
// consumer raises on insufficient stock (a dead-letter queue takes such a message):
// the port produces it to --dlq-topic and goes on.
func runPortInventariProcess(ctx context.Context, args []string) error {
	fs := cli.NewFlags("bench system _port-inventari", "the reference idempotent consumer, ported to Go (benchmark peer)")
	dbURL := cli.DatabaseURLFlag(fs)
	brokers := cli.BrokersFlag(fs)
	group := fs.String("group", "inventari", "consumer group")
	topic := fs.String("topic", comandes.Topic, "topic")
	dlq := fs.String("dlq-topic", comandes.Topic+contract.DLQSuffix, "where refused orders go")
	withOutbox := fs.Bool("outbox", true, "also write estoc.actualitzat to the outbox")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	bs, err := cli.RequireBrokers(*brokers)
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	cl, err := kgo.NewClient(kgo.SeedBrokers(bs...), kgo.ConsumerGroup(*group), kgo.ConsumeTopics(*topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.DisableAutoCommit(), kgo.AllowAutoTopicCreation())
	if err != nil {
		return err
	}
	defer cl.Close()
	var commitMu sync.Mutex
	var commitErr error
	for {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err := fetches.Err0(); err != nil {
			return err
		}
		for _, rec := range fetches.Records() {
			var e portEnvelope
			if err := json.Unmarshal(rec.Value, &e); err != nil {
				return err
			}
			if e.Type == comandes.TypeCreated {
				err := portProcessOrder(ctx, conn, &e, *withOutbox)
				if errors.Is(err, errPortInsufficient) {
					err = cl.ProduceSync(ctx, &kgo.Record{Topic: *dlq, Key: rec.Key, Value: rec.Value, Headers: rec.Headers}).FirstErr()
				}
				if err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
			}
			// SEMPRE després de la transacció de BD.
			cl.CommitOffsets(ctx, map[string]map[int32]kgo.EpochOffset{rec.Topic: {rec.Partition: {Epoch: rec.LeaderEpoch, Offset: rec.Offset + 1}}},
				func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, _ *kmsg.OffsetCommitResponse, err error) {
					if err != nil {
						commitMu.Lock()
						commitErr = err
						commitMu.Unlock()
					}
				})
			commitMu.Lock()
			err := commitErr
			commitMu.Unlock()
			if err != nil && ctx.Err() == nil {
				return fmt.Errorf("commit: %w", err)
			}
		}
	}
}

var errPortInsufficient = errors.New("out of stock")

// portProcessOrder is the reference consumer's processar_comanda_creada.
func portProcessOrder(ctx context.Context, conn *pgx.Conn, e *portEnvelope, withOutbox bool) error {
	var o struct {
		ID    string `json:"id"`
		Lines []struct {
			Product  string `json:"producte"`
			Quantity int    `json:"quantitat"`
		} `json:"linies"`
	}
	if err := json.Unmarshal(e.Data, &o); err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		var key string
		err := tx.QueryRow(ctx, "INSERT INTO missatges_processats (id_missatge, consumidor) VALUES ($1, $2) "+
			"ON CONFLICT DO NOTHING RETURNING id_missatge", e.ID, inventari.ConsumerDecrement).Scan(&key)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // duplicat
		}
		if err != nil {
			return err
		}
		for _, l := range o.Lines {
			if !withOutbox {
				tag, err := tx.Exec(ctx, "UPDATE estoc SET unitats = unitats - $1 WHERE producte = $2 AND unitats >= $1", l.Quantity, l.Product)
				if err != nil {
					return err
				}
				if tag.RowsAffected() == 0 {
					return fmt.Errorf("%w: %s", errPortInsufficient, l.Product)
				}
				continue
			}
			var after int
			err := tx.QueryRow(ctx, "UPDATE estoc SET unitats = unitats - $1 WHERE producte = $2 AND unitats >= $1 RETURNING unitats",
				l.Quantity, l.Product).Scan(&after)
			if errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("%w: %s", errPortInsufficient, l.Product)
			}
			if err != nil {
				return err
			}
			carrega, _ := json.Marshal(inventari.StockUpdated{Product: l.Product, Before: after + l.Quantity, After: after,
				Reason: inventari.ReasonOrder, OrderID: o.ID})
			if _, err := tx.Exec(ctx, "INSERT INTO outbox (id, agregat, agregat_id, tipus, versio, carrega) VALUES ($1, $2, $3, $4, 1, $5)",
				uuid.New(), inventari.Aggregate, l.Product, inventari.TypeStockUpdated, carrega); err != nil {
				return err
			}
		}
		return nil
	})
}
