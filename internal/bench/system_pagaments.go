package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/transport/amqp"
)

// rrConfig sizes the pagaments part.
type rrConfig struct {
	serial, requests, callers, peerWorkers int
}

// rrPhase is one measured phase: its callers, requests, rate and latencies.
type rrPhase struct {
	callers, requests int
	seconds           float64
	p50, p99          float64
}

func (ph rrPhase) rate() float64 { return round2(float64(ph.requests) / ph.seconds) }

// pagaments: card authorisations over RabbitMQ with the km0 client
// (requestreply/amqprr), answered by `km0 serve pagaments` with its defaults
// and by a plain amqp091-go server that stores each response in PostgreSQL;
// first by one caller, then by cfg.callers at once.
func (b *sysBench) pagaments(ctx context.Context, rounds int, cfg rrConfig) error {
	k, err := b.startKafka(ctx) // km0 serve pagaments also runs its relay and consumer
	if err != nil {
		return err
	}
	defer k.stop()
	conn, err := amqp.Dial(ctx, amqp.Config{URL: b.amqpURL, Name: "km0-bench-system"})
	if err != nil {
		return err
	}
	defer conn.Close()
	// km0's queue is the contract's: refuse to share it with a running
	// server, and delete it afterwards only if this run created it.
	var existed bool
	err = conn.Do(ctx, func(ch *amqp091.Channel) error {
		q, err := ch.QueueDeclarePassive(pagaments.AuthQueue, true, false, false, false, nil)
		if err != nil {
			return nil // absent (the channel is closed by the broker; Do opens another next time)
		}
		existed = true
		if q.Consumers > 0 {
			return fmt.Errorf("queue %s already has %d consumers: another pagaments server is running", pagaments.AuthQueue, q.Consumers)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if !existed {
		defer func() {
			_ = conn.Do(context.Background(), func(ch *amqp091.Channel) error {
				for _, q := range []string{pagaments.AuthQueue, contract.DLQName(pagaments.AuthQueue)} {
					_, _ = ch.QueueDelete(q, true, false, false)
				}
				return nil
			})
		}()
	}
	type sideResult struct{ one, many rrPhase }
	res := map[string][]sideResult{}
	var ratios, rss []float64
	for r := 1; r <= rounds; r++ {
		got := map[string]sideResult{}
		for _, side := range sidesOf(r) {
			one, many, cpu, mb, err := b.pagamentsRound(ctx, k, conn, side, r, cfg)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", r, side, err)
			}
			for _, ph := range []rrPhase{one, many} {
				emit(map[string]any{"bench": "system_pagaments", "side": side, "round": r, "callers": ph.callers, "requests": ph.requests,
					"seconds": round2(ph.seconds), "req_per_s": ph.rate(), "p50_ms": ph.p50, "p99_ms": ph.p99, "rss_mb": round2(mb), "server_cpu_s": round2(cpu.Seconds())})
			}
			got[side] = sideResult{one, many}
			res[side] = append(res[side], got[side])
			if side == sideKm0 {
				rss = append(rss, mb)
			}
		}
		ratios = append(ratios, ratio(got[sideKm0].many.rate(), got[sidePort].many.rate()))
		emit(map[string]any{"bench": "system_pagaments_round", "round": r, "callers": cfg.callers,
			"req_per_s": got[sideKm0].many.rate(), "peer_req_per_s": got[sidePort].many.rate(), "ratio": ratios[len(ratios)-1],
			"p50_ms_1_caller": got[sideKm0].one.p50, "peer_p50_ms_1_caller": got[sidePort].one.p50})
	}
	med := func(side string, f func(sideResult) float64) float64 {
		var xs []float64
		for _, x := range res[side] {
			xs = append(xs, f(x))
		}
		return med2(xs)
	}
	emit(map[string]any{"bench": "system_pagaments", "what": "km0 serve pagaments (defaults) vs a plain amqp091-go server storing each response in PostgreSQL; km0's amqprr client",
		"rounds": rounds, "callers": cfg.callers, "requests": cfg.requests,
		"req_per_s":      med(sideKm0, func(x sideResult) float64 { return x.many.rate() }),
		"peer_req_per_s": med(sidePort, func(x sideResult) float64 { return x.many.rate() }),
		"ratios":         ratios, "median_ratio": med2(ratios),
		"p50_ms":               med(sideKm0, func(x sideResult) float64 { return x.many.p50 }),
		"p99_ms":               med(sideKm0, func(x sideResult) float64 { return x.many.p99 }),
		"peer_p50_ms":          med(sidePort, func(x sideResult) float64 { return x.many.p50 }),
		"peer_p99_ms":          med(sidePort, func(x sideResult) float64 { return x.many.p99 }),
		"p50_ms_1_caller":      med(sideKm0, func(x sideResult) float64 { return x.one.p50 }),
		"p99_ms_1_caller":      med(sideKm0, func(x sideResult) float64 { return x.one.p99 }),
		"peer_p50_ms_1_caller": med(sidePort, func(x sideResult) float64 { return x.one.p50 }),
		"peer_p99_ms_1_caller": med(sidePort, func(x sideResult) float64 { return x.one.p99 }),
		"rss_mb":               round2(slices.Max(rss)),
		"peer_workers":         cfg.peerWorkers,
		"requests_1_caller":    cfg.serial,
	})
	return nil
}

// pagamentsRound starts one side's server as a process on a fresh database,
// waits until it answers, runs the two phases, and checks that every request
// got its own approval and that the server stored one row per request.
func (b *sysBench) pagamentsRound(ctx context.Context, k *broker, conn *amqp.Conn, side string, r int, cfg rrConfig) (one, many rrPhase, cpu time.Duration, rssMB float64, err error) {
	var (
		name, dbURL, queue, count string
		args, env                 []string
		key                       []byte // signs the requests and checks the replies: km0's side only
	)
	pname := "km0 serve pagaments"
	if side == sideKm0 {
		var extra []string
		name, dbURL, extra, err = b.serviceDB(ctx, pagaments.Name, strconv.Itoa(r))
		queue, count = pagaments.AuthQueue, "SELECT count(*) FROM autoritzacions WHERE comanda_id LIKE $1"
		env = b.serviceEnv() // with KM0_AMQP_URL: request/reply over RabbitMQ
		// km0 serve pagaments needs a signing key; the peer verifies nothing.
		if key = requestreply.SigningKeyFromEnv(); key == nil && err == nil {
			key, err = newSigningKey()
		}
		env = append(env, requestreply.SigningKeyEnv+"="+string(key))
		args = append([]string{"serve", pagaments.Name, "--brokers", k.addr}, extra...)
	} else {
		pname = "plain amqp091-go server"
		name = b.dbName(pagaments.Name, strconv.Itoa(r), sidePort)
		dbURL, err = b.createDB(ctx, name)
		queue, count = "km0_bench_"+b.tag+"_"+strconv.Itoa(r)+".autoritzacions", "SELECT count(*) FROM respostes WHERE id_peticio LIKE 'autoritzacio-' || $1"
		env = []string{"KM0_DATABASE_URL=" + dbURL, "KM0_AMQP_URL=" + b.amqpURL}
		args = []string{"bench", "system", "_port-pagaments",
			"--queue", queue, "--workers", strconv.Itoa(cfg.peerWorkers)}
	}
	if err != nil {
		return one, many, 0, 0, err
	}
	defer b.dropDB(name)
	p, err := b.spawn(pname, env, args...)
	if err != nil {
		return one, many, 0, 0, err
	}
	defer p.stop()
	cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: conn, SigningKey: key})
	if err != nil {
		return one, many, 0, 0, err
	}
	defer cl.Close()
	ask := func(ctx context.Context, id string) error {
		amount := int64(1000 + rand.IntN(50_000))
		body, _ := json.Marshal(pagaments.AuthRequest{OrderID: id, TotalCents: amount})
		out, err := cl.Request(ctx, queue, "autoritzacio-"+id, body)
		if err != nil {
			return err
		}
		var resp pagaments.AuthResponse
		if err := json.Unmarshal(out, &resp); err != nil {
			return fmt.Errorf("unreadable reply %q: %w", out, err)
		}
		if resp.OrderID != id || !resp.Approved {
			return fmt.Errorf("reply %s to the request of %s: want its approval", out, id)
		}
		return nil
	}
	warm := 0
	err = b.waitUntil(ctx, pname+" to answer", p, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		warm++
		err := ask(ctx, fmt.Sprintf("W-%s-%d", b.tag, warm))
		if err != nil && !errors.Is(err, requestreply.ErrNoService) && !errors.Is(err, requestreply.ErrTimeout) {
			return false, err
		}
		return err == nil, nil
	})
	if err != nil {
		return one, many, 0, 0, err
	}
	for i := range 50 { // warm up both sides alike
		if err := ask(ctx, fmt.Sprintf("W-%s-%d-%d", b.tag, warm, i)); err != nil {
			return one, many, 0, 0, fmt.Errorf("warm-up: %w", err)
		}
	}
	next := atomic.Int64{}
	run := func(callers, requests int) (rrPhase, error) {
		lat := make([][]time.Duration, callers)
		var firstErr error
		var mu sync.Mutex
		var wg sync.WaitGroup
		start := time.Now()
		for c := range callers {
			wg.Go(func() {
				for {
					i := next.Add(1)
					if i > int64(requests) {
						return
					}
					t0 := time.Now()
					if err := ask(ctx, fmt.Sprintf("P-%s-%07d", b.tag, i)); err != nil {
						mu.Lock()
						if firstErr == nil {
							firstErr = err
						}
						mu.Unlock()
						return
					}
					lat[c] = append(lat[c], time.Since(t0))
				}
			})
		}
		wg.Wait()
		elapsed := time.Since(start)
		all := slices.Concat(lat...)
		slices.Sort(all)
		if firstErr != nil {
			return rrPhase{}, firstErr
		}
		return rrPhase{callers: callers, requests: len(all), seconds: elapsed.Seconds(), p50: pctl(all, 50), p99: pctl(all, 99)}, nil
	}
	if one, err = run(1, cfg.serial); err != nil {
		return one, many, 0, 0, err
	}
	next.Store(int64(cfg.serial))
	if many, err = run(cfg.callers, cfg.serial+cfg.requests); err != nil {
		return one, many, 0, 0, err
	}
	many.requests = cfg.requests
	cpu, rssMB = procUsage(p)
	pool, err := cli.OpenPool(ctx, dbURL, 1)
	if err != nil {
		return one, many, 0, 0, err
	}
	defer pool.Close()
	var stored int
	if err := pool.QueryRow(ctx, count, "P-"+b.tag+"-%").Scan(&stored); err != nil {
		return one, many, 0, 0, err
	}
	if stored != cfg.serial+cfg.requests {
		return one, many, 0, 0, fmt.Errorf("%s stored %d responses for %d answered requests", pname, stored, cfg.serial+cfg.requests)
	}
	return one, many, cpu, rssMB, nil
}

// runPortPagamentsProcess is `km0 bench system _port-pagaments`: a plain
// amqp091-go request/reply server, the peer of km0's. It consumes --queue
// (prefetch 2 × workers, manual ack) with --workers goroutines; for each
// request it stores the response with one INSERT ... ON CONFLICT per request
// id (message_id), returning the stored row, publishes it to reply_to with the
// correlation_id, then acks. No publisher confirms.
func runPortPagamentsProcess(ctx context.Context, args []string) error {
	fs := cli.NewFlags("bench system _port-pagaments", "a plain amqp091-go authorisation server (benchmark peer)")
	dbURL := cli.DatabaseURLFlag(fs)
	amqpURL := cli.SecretString(fs, "amqp-url", cmpOr(os.Getenv("KM0_AMQP_URL"), amqp.URLDefault), "RabbitMQ URL (default $KM0_AMQP_URL, else the local guest broker)")
	queue := fs.String("queue", pagaments.AuthQueue, "request queue (declared exclusive: it goes with this process)")
	workers := fs.Int("workers", 16, "handler goroutines")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	pool, err := cli.OpenPool(ctx, *dbURL, int32(*workers))
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS respostes (
		id_peticio TEXT PRIMARY KEY, resposta JSONB NOT NULL, creat_en TIMESTAMPTZ NOT NULL DEFAULT now())`); err != nil {
		return err
	}
	conn, err := amqp091.Dial(*amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	pub, err := conn.Channel()
	if err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(*queue, false, false, true, false, nil); err != nil {
		return err
	}
	if err := ch.Qos(2**workers, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(*queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	errc := make(chan error, *workers)
	var wg sync.WaitGroup
	for range *workers {
		wg.Go(func() {
			for d := range deliveries {
				if err := portAnswer(ctx, pool, pub, &d); err != nil {
					errc <- err
					return
				}
			}
		})
	}
	select {
	case <-ctx.Done():
		_ = ch.Close()
		wg.Wait()
		return nil
	case err := <-errc:
		return err
	}
}

// portAnswer handles one request of the plain server.
func portAnswer(ctx context.Context, pool *pgxpool.Pool, pub *amqp091.Channel, d *amqp091.Delivery) error {
	var req pagaments.AuthRequest
	if err := json.Unmarshal(d.Body, &req); err != nil || req.OrderID == "" || d.ReplyTo == "" {
		return d.Reject(false)
	}
	resp := pagaments.AuthResponse{OrderID: req.OrderID, Approved: req.TotalCents <= pagaments.AuthLimitCentsDefault}
	if !resp.Approved {
		resp.Reason = "import_excessiu"
	}
	body, _ := json.Marshal(resp)
	var stored []byte
	err := pool.QueryRow(ctx, `INSERT INTO respostes (id_peticio, resposta) VALUES ($1, $2)
		ON CONFLICT (id_peticio) DO UPDATE SET id_peticio = EXCLUDED.id_peticio RETURNING resposta::text`,
		cmpOr(d.MessageId, d.CorrelationId), string(body)).Scan(&stored)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	err = pub.PublishWithContext(ctx, "", d.ReplyTo, false, false, amqp091.Publishing{
		ContentType: "application/json", CorrelationId: d.CorrelationId, Body: stored,
		Headers: amqp091.Table{requestreply.HeaderResult: requestreply.ResultOK}})
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	return d.Ack(false)
}
