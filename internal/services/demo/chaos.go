package demo

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
	"github.com/km0/km0/transport/kafka"
)

// Defaults of ChaosConfig.
const (
	ChaosOrdersDefault        = 2000
	ChaosKillsDefault         = 15
	ChaosDurationDefault      = 150 * time.Second
	ChaosBrokerDownDefault    = 10 * time.Second
	ChaosSettleTimeoutDefault = 3 * time.Minute
	// ChaosStopGrace is how long a child gets after SIGTERM at the end of
	// the run before it is SIGKILLed (system.ShutdownGraceDefault twice, plus a margin).
	ChaosStopGrace = 2*system.ShutdownGraceDefault + 5*time.Second
)

// ChaosConfig configures RunChaos.
type ChaosConfig struct {
	Orders   int           // orders submitted through POST /comandes; default ChaosOrdersDefault
	Clients  int           // concurrent HTTP clients; default ClientsDefault
	Kills    int           // SIGKILLs of services; default ChaosKillsDefault (0 is taken as the default; use NoKills for none)
	NoKills  bool          // no SIGKILL of services
	Duration time.Duration // the orders are spread over it and the faults fall within it; default ChaosDurationDefault
	// BrokerDown is how long the embedded broker stays SIGKILLed; default
	// ChaosBrokerDownDefault. NoBrokerKill leaves it alone.
	BrokerDown   time.Duration
	NoBrokerKill bool
	// OwnPostgres runs a throwaway PostgreSQL cluster (initdb in a temporary
	// folder) and restarts it -m fast and -m immediate during the run.
	// Otherwise the server comes from DatabaseURL or FindServer and is never
	// restarted.
	OwnPostgres bool
	DatabaseURL string
	// NoAuthorize turns off comandes' request/reply authorisation with pagaments.
	NoAuthorize   bool
	SettleTimeout time.Duration // bound of the wait for the system to settle after the last fault; default ChaosSettleTimeoutDefault
	// Seed draws the fault schedule and the orders; 0 draws a random seed
	// (printed, and in the report, so that the run can be replayed).
	Seed uint64
	// Executable is the km0 binary to run the children with; default os.Executable().
	Executable string
	// KeepDir keeps the folder with the children's logs and the broker's
	// data (always kept when the run fails).
	KeepDir  bool
	OnReport func(*ChaosReport) // receives the report before the children stop
	Out      io.Writer          // progress; default io.Discard
}

// ChaosReport is the reconciliation of a chaos run.
type ChaosReport struct {
	Report
	Seed        uint64               `json:"seed"`
	Dir         string               `json:"dir"`
	Planned     []Fault              `json:"planned_faults"`
	Done        []FaultDone          `json:"faults"`
	Processes   map[string]ProcCount `json:"processes"`
	Poison      []*PoisonResult      `json:"poison"`
	LastFault   float64              `json:"last_fault_s"`          // seconds from the start of the drive
	DriveEnd    float64              `json:"drive_end_s"`           // seconds from the start of the drive
	Settled     bool                 `json:"settled"`               //
	SettleAfter float64              `json:"settled_after_last_s"`  // seconds from the last fault (or the last answer, if later) to settled
	SettleFault float64              `json:"settled_after_fault_s"` // seconds from the last fault to settled
	StopSecs    map[string]float64   `json:"stop_s,omitempty"`      // seconds each child took to stop on SIGTERM
	Stuck       []string             `json:"stuck,omitempty"`       // groups/partitions with lag when the settle wait gave up
}

// FaultDone is a fault as it happened.
type FaultDone struct {
	Fault
	Start float64 `json:"start_s"` // seconds from the start of the drive
	End   float64 `json:"end_s"`   // when the target was started again
	Err   string  `json:"error,omitempty"`
}

// ProcCount counts a child's life.
type ProcCount struct {
	Starts  int `json:"starts"`
	Kills   int `json:"sigkills"`
	Crashes int `json:"crashes"` // exits the harness did not cause (restarted after 1 s)
}

// chaos is one run.
type chaos struct {
	cfg          ChaosConfig
	say          func(format string, args ...any)
	dir          string
	server       *Server
	suffix       string
	brokers      []string
	comandesAddr string
	broker       *proc
	procs        map[string]*proc
	kcl          *kgo.Client
	t0           time.Time // start of the drive

	mu         sync.Mutex
	done       []FaultDone
	poison     []*Poison
	poisonLeft int           // poison batches not produced yet
	poisonDone chan struct{} // closed when poisonLeft reaches 0
}

// RunChaos runs km0 demo --chaos: the six services as separate `km0 serve`
// processes and the broker as a `km0 kafka --data-dir` process, orders driven
// through POST /comandes while services and the broker are SIGKILLed and
// restarted (and, with OwnPostgres, PostgreSQL restarted), poison records
// produced straight to the topics; then it waits for the system to settle and
// reconciles the databases with the topics. The error is for a run that
// could not start; a run whose invariants fail returns a report with OK
// false and no error.
func RunChaos(ctx context.Context, cfg ChaosConfig) (*ChaosReport, error) {
	cfg.Orders = cmp.Or(cfg.Orders, ChaosOrdersDefault)
	cfg.Clients = cmp.Or(cfg.Clients, ClientsDefault)
	cfg.Kills = cmp.Or(cfg.Kills, ChaosKillsDefault)
	if cfg.NoKills {
		cfg.Kills = 0
	}
	cfg.Duration = cmp.Or(cfg.Duration, ChaosDurationDefault)
	cfg.BrokerDown = cmp.Or(cfg.BrokerDown, ChaosBrokerDownDefault)
	if cfg.NoBrokerKill {
		cfg.BrokerDown = 0
	}
	cfg.SettleTimeout = cmp.Or(cfg.SettleTimeout, ChaosSettleTimeoutDefault)
	if cfg.Seed == 0 {
		cfg.Seed = rand.Uint64()>>1 + 1
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Orders < 1 || cfg.Clients < 1 || cfg.Kills < 0 || cfg.Duration < time.Second {
		return nil, fmt.Errorf("demo --chaos: --orders and clients must be positive, --kills not negative, --duration at least 1s (got %d, %d, %d, %v)",
			cfg.Orders, cfg.Clients, cfg.Kills, cfg.Duration)
	}
	if cfg.Executable == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("demo --chaos: cannot find the km0 binary to start the services with: %w", err)
		}
		cfg.Executable = exe
	}
	start := time.Now()
	c := &chaos{cfg: cfg, procs: map[string]*proc{}}
	c.say = func(format string, args ...any) {
		fmt.Fprintf(cfg.Out, "[%6.1fs] %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, args...))
	}
	var err error
	if c.dir, err = os.MkdirTemp("", "km0-chaos-"); err != nil {
		return nil, err
	}
	keep := cfg.KeepDir
	defer func() {
		if !keep {
			os.RemoveAll(c.dir)
		}
	}()
	c.say("seed %d (km0 demo --chaos --seed %d replays this schedule) · process logs in %s", cfg.Seed, cfg.Seed, c.dir)

	switch {
	case cfg.OwnPostgres:
		c.say("PostgreSQL: starting a cluster of its own (initdb in a temporary folder)")
		c.server, err = StartThrowaway(ctx)
	case cfg.DatabaseURL != "":
		c.server = &Server{URL: cfg.DatabaseURL, Source: "--database-url"}
	default:
		c.server, err = FindServer(ctx, func(s string) { c.say("%s", s) })
	}
	if err != nil {
		return nil, err
	}
	defer c.server.Close()
	c.say("PostgreSQL: %s (%s)", c.server.Source, redact.URL(c.server.URL))

	run := randomSuffix()
	c.suffix = "chaos_" + run
	defer c.dropDatabases(ctx)
	if err := c.startChildren(ctx); err != nil {
		c.stopChildren()
		keep = true
		return nil, fmt.Errorf("%w (logs in %s)", err, c.dir)
	}
	defer func() {
		if c.broker != nil {
			c.stopChildren()
		}
	}()
	if c.kcl, err = kafka.NewClient(c.brokers); err != nil {
		return nil, err
	}
	defer c.kcl.Close()

	plan := makePlan(cfg.Orders, cfg.Seed, run, !cfg.NoAuthorize)
	restock := restockFor(plan)
	if err := c.restock(ctx, restock); err != nil {
		return nil, err
	}
	c.say("restocked %d products so that only the aged cheese (5 units) runs out", len(restock))

	schedule := makeSchedule(cfg.Seed, cfg.Kills, cfg.Duration, cfg.BrokerDown, c.server.restart != nil)
	report := &ChaosReport{Seed: cfg.Seed, Dir: c.dir, Planned: schedule}
	report.Run, report.Database = run, c.server.Source
	report.RequestReply = "Kafka"
	if os.Getenv("KM0_AMQP_URL") != "" {
		report.RequestReply = "RabbitMQ"
	}
	if cfg.NoAuthorize {
		report.RequestReply += " (autoritzacions desactivades)"
	}
	c.say("schedule: %d orders over %v, %s", cfg.Orders, cfg.Duration, summarize(schedule))
	c.poisonDone = make(chan struct{})
	for _, f := range schedule {
		if f.Kind == FaultPoison {
			c.poisonLeft++
		}
	}
	if c.poisonLeft == 0 {
		close(c.poisonDone)
	}

	// comandes refuses Perpinyà (422) once it holds repartiment's coverage.
	cp, err := c.pool(ctx, comandes.Name)
	if err != nil {
		return nil, err
	}
	err = waitCoverage(ctx, cp, UncoveredCity, false)
	cp.Close()
	if err != nil {
		return nil, err
	}

	// Drive and faults at once.
	c.t0 = time.Now()
	driveCtx, cancelDrive := context.WithTimeout(ctx, cfg.Duration+cfg.SettleTimeout)
	defer cancelDrive()
	d := &driver{url: c.comandesURL(), client: &http.Client{Timeout: 30 * time.Second}}
	// The last orders wait for every poison batch: each poison record must
	// have healthy events after it in its partition, even when a batch was
	// held up by the broker outage.
	holdFrom := cfg.Orders - max(cfg.Orders/5, min(cfg.Orders/2, 100))
	d.gate = func(ctx context.Context, i int) {
		if i == holdFrom {
			select {
			case <-ctx.Done():
			case <-c.poisonDone:
			}
		}
		wait := time.Until(c.t0.Add(time.Duration(int64(cfg.Duration) * int64(i) / int64(cfg.Orders))))
		if wait > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(wait):
			}
		}
	}
	var sent, faultsDone sendCounter
	d.onOrder = func(done int) { sent.set(done) }
	faultsFinished := make(chan struct{})
	go func() {
		defer close(faultsFinished)
		c.runFaults(driveCtx, schedule, &faultsDone)
	}()
	progressDone := make(chan struct{})
	go c.progress(driveCtx, progressDone, cfg.Orders, len(schedule), &sent, &faultsDone)
	sub := d.run(driveCtx, plan, cfg.Clients)
	driveEnd := time.Since(c.t0)
	<-faultsFinished
	close(progressDone)
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	c.say("orders sent by %.1fs: %d accepted, %d duplicates absorbed, %d answers 503 retried, %d unanswered",
		driveEnd.Seconds(), sub.Accepted, sub.Replayed, sub.Unavailable, sub.Unanswered)

	report.Done = c.faultsDone()
	lastFault := time.Duration(0)
	for _, f := range report.Done {
		lastFault = max(lastFault, time.Duration(f.End*float64(time.Second)))
	}
	report.LastFault, report.DriveEnd = lastFault.Seconds(), driveEnd.Seconds()
	c.say("last fault over at %.1fs; waiting for the system to settle (outboxes empty, lag 0 in every group, no delivery pending)", lastFault.Seconds())

	from := max(lastFault, driveEnd)
	settled, why, stuck := c.settle(ctx, c.t0.Add(from).Add(cfg.SettleTimeout))
	settledAt := time.Since(c.t0)
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	report.Settled, report.Stuck = settled, stuck
	report.SettleAfter = (settledAt - from).Seconds()
	report.SettleFault = (settledAt - lastFault).Seconds()
	if settled {
		c.say("SETTLED %.1f s after the last fault (%.1f s after the last answer)", report.SettleFault, (settledAt - driveEnd).Seconds())
	} else {
		c.say("NOT settled %.0f s after the last fault: %s", report.SettleFault, why)
		for _, s := range stuck {
			c.say("  stuck: %s", s)
		}
	}
	report.check("system settled: outboxes empty, lag 0 in every group, no delivery pending", settled,
		"%s; %.1f s after the last fault (limit %v)", why, report.SettleFault, cfg.SettleTimeout)
	c.checkFaults(report, schedule)
	if err := c.reconcile(ctx, plan, sub, restock, report); err != nil {
		keep = true
		return nil, fmt.Errorf("demo --chaos: reconcile: %w (logs in %s)", err, c.dir)
	}
	report.Elapsed = time.Since(start).Seconds()
	report.OK = len(report.Failed()) == 0
	report.Verdict = verdict(report.Invariants)
	if !report.OK {
		keep = true
	}
	report.Processes = map[string]ProcCount{}
	for name, p := range c.allProcs() {
		s, k, cr := p.counts()
		report.Processes[name] = ProcCount{Starts: s, Kills: k, Crashes: cr}
	}
	report.StopSecs = c.stopChildren()
	report.Elapsed = time.Since(start).Seconds()
	if cfg.OnReport != nil {
		cfg.OnReport(report)
	}
	return report, nil
}

type sendCounter struct {
	mu sync.Mutex
	n  int
}

func (s *sendCounter) set(n int) {
	s.mu.Lock()
	s.n = max(s.n, n)
	s.mu.Unlock()
}

func (s *sendCounter) add() {
	s.mu.Lock()
	s.n++
	s.mu.Unlock()
}

func (s *sendCounter) get() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

func summarize(s []Fault) string {
	n := map[string]int{}
	for _, f := range s {
		n[f.Kind]++
	}
	var parts []string
	for _, k := range []string{FaultKill, FaultBroker, FaultPGFast, FaultPGImmediate, FaultPoison} {
		if n[k] > 0 {
			parts = append(parts, fmt.Sprintf("%d× %s", n[k], k))
		}
	}
	return strings.Join(parts, ", ")
}

func (c *chaos) progress(ctx context.Context, done <-chan struct{}, orders, faults int, sent, faultsDone *sendCounter) {
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-done:
			return
		case <-t.C:
			var down []string
			for _, name := range append([]string{"kafka"}, system.Services...) {
				if !c.allProcs()[name].running() {
					down = append(down, name)
				}
			}
			c.say("orders %d/%d · faults %d/%d · down now: %s", sent.get(), orders, faultsDone.get(), faults, listOr(down, "none"))
		}
	}
}

func (c *chaos) allProcs() map[string]*proc {
	out := map[string]*proc{"kafka": c.broker}
	for k, v := range c.procs {
		out[k] = v
	}
	return out
}

func (c *chaos) comandesURL() string { return "http://" + c.comandesAddr }

// startChildren starts the broker and then the six services, each waited
// for, in the order of system.Services.
func (c *chaos) startChildren(ctx context.Context) error {
	kport, err := freePort()
	if err != nil {
		return err
	}
	addr := "127.0.0.1:" + strconv.Itoa(kport)
	c.brokers = []string{addr}
	c.broker = newProc("kafka", c.cfg.Executable, filepath.Join(c.dir, "kafka.log"), "km0 kafka: listening",
		"kafka", "--data-dir", filepath.Join(c.dir, "kafka-data"), "--addr", addr)
	if err := c.broker.start(); err != nil {
		return err
	}
	upCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := c.broker.waitUp(upCtx); err != nil {
		return err
	}
	c.say("Kafka: km0 kafka --data-dir (process %s) at %s", "kafka", addr)
	cport, err := freePort()
	if err != nil {
		return err
	}
	c.comandesAddr = "127.0.0.1:" + strconv.Itoa(cport)
	for _, name := range system.Services {
		args := []string{"serve", name, "--database-url", c.server.URL, "--database-suffix", c.suffix, "--brokers", addr}
		if name == comandes.Name && !c.cfg.NoAuthorize {
			args = append(args, "--authorize")
		}
		if name == comandes.Name {
			args = append(args, "--http", "comandes="+c.comandesAddr)
		}
		if name == repartiment.Name { // couriers free again quickly, so that every delivery is assigned by the end
			args = append(args, "--delivery-time", "150ms", "--assign-interval", "100ms")
		}
		p := newProc(name, c.cfg.Executable, filepath.Join(c.dir, name+".log"), "km0 serve "+name+": running", args...)
		c.procs[name] = p
		if err := p.start(); err != nil {
			return err
		}
		if err := p.waitUp(upCtx); err != nil {
			return err
		}
	}
	c.say("services running as separate processes: %s (databases km0_<service>_%s)", strings.Join(system.Services, ", "), c.suffix)
	return nil
}

// stopChildren stops the services (in parallel) and then the broker, and
// returns how long each took.
func (c *chaos) stopChildren() map[string]float64 {
	out := map[string]float64{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for name, p := range c.procs {
		wg.Go(func() {
			t := time.Now()
			if _, err := p.stop(ChaosStopGrace); err != nil {
				c.say("%v", err)
			}
			mu.Lock()
			out[name] = time.Since(t).Seconds()
			mu.Unlock()
		})
	}
	wg.Wait()
	if c.broker != nil {
		t := time.Now()
		_, _ = c.broker.stop(ChaosStopGrace)
		out["kafka"] = time.Since(t).Seconds()
	}
	return out
}

func (c *chaos) dropDatabases(ctx context.Context) {
	if c.cfg.OwnPostgres {
		return // the cluster goes with its folder
	}
	dropCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	for _, s := range system.Services {
		_ = svc.DropDatabase(dropCtx, c.server.URL, svc.DatabaseName(s, c.suffix))
	}
}

// restock adds units through inventari's own code (stock and outbox in one
// transaction), before any fault.
func (c *chaos) restock(ctx context.Context, restock map[string]int) error {
	pool, err := c.pool(ctx, inventari.Name)
	if err != nil {
		return err
	}
	defer pool.Close()
	reg, err := schema.Default()
	if err != nil {
		return err
	}
	inv, err := inventari.New(inventari.Config{Pool: pool, Outbox: outbox.New(outbox.Config{Validate: reg.Validate})})
	if err != nil {
		return err
	}
	prods := make([]string, 0, len(restock))
	for p := range restock {
		prods = append(prods, p)
	}
	sort.Strings(prods)
	for _, p := range prods {
		if err := inv.Restock(ctx, p, restock[p]); err != nil {
			return fmt.Errorf("restock %s: %w", p, err)
		}
	}
	return nil
}

// runFaults runs the schedule: each fault at its moment, faults of one
// target one after another.
func (c *chaos) runFaults(ctx context.Context, schedule []Fault, done *sendCounter) {
	locks := map[string]*sync.Mutex{}
	lock := func(k string) *sync.Mutex {
		if locks[k] == nil {
			locks[k] = &sync.Mutex{}
		}
		return locks[k]
	}
	var wg sync.WaitGroup
	batch := 0
	for _, f := range schedule {
		var l *sync.Mutex
		switch f.Kind {
		case FaultKill:
			l = lock(f.Target)
		case FaultBroker:
			l = lock("kafka")
		case FaultPGFast, FaultPGImmediate:
			l = lock("postgres")
		default:
			l = lock(fmt.Sprintf("poison-%d", batch))
		}
		b := batch
		if f.Kind == FaultPoison {
			batch++
		}
		wg.Go(func() {
			defer done.add()
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Until(c.t0.Add(f.At))):
			}
			l.Lock()
			defer l.Unlock()
			fd := FaultDone{Fault: f, Start: time.Since(c.t0).Seconds()}
			err := c.fault(ctx, f, b)
			fd.End = time.Since(c.t0).Seconds()
			if err != nil {
				fd.Err = err.Error()
				c.say("fault %s: %v", f, err)
			}
			c.mu.Lock()
			c.done = append(c.done, fd)
			c.mu.Unlock()
		})
	}
	wg.Wait()
}

func (c *chaos) fault(ctx context.Context, f Fault, batch int) error {
	sleep := func(d time.Duration) {
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
	}
	switch f.Kind {
	case FaultKill:
		p := c.procs[f.Target]
		c.say("SIGKILL %s (back in %.1f s)", f.Target, f.Down.Seconds())
		p.kill()
		sleep(f.Down)
		return p.start()
	case FaultBroker:
		c.say("SIGKILL kafka (back in %.1f s, with the same --data-dir)", f.Down.Seconds())
		c.broker.kill()
		sleep(f.Down)
		return c.broker.start()
	case FaultPGFast, FaultPGImmediate:
		mode := strings.TrimPrefix(f.Kind, "postgres-")
		c.say("PostgreSQL: pg_ctl restart -m %s", mode)
		err := c.server.Restart(ctx, mode)
		if err == nil {
			c.say("PostgreSQL: running again after -m %s", mode)
		}
		return err
	case FaultPoison:
		b := poisonBatch(batch)
		pctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		err := producePoison(pctx, c.kcl, b)
		c.mu.Lock()
		for _, p := range b {
			if p.Partition >= 0 { // produced, even if a later one of the batch was not
				c.poison = append(c.poison, p)
			}
		}
		if c.poisonLeft--; c.poisonLeft == 0 {
			close(c.poisonDone)
		}
		c.mu.Unlock()
		if err == nil {
			c.say("%d poison records produced straight onto the topics (batch %d)", len(b), batch)
		}
		return err
	}
	return errors.New("unknown fault " + f.Kind)
}

func (c *chaos) faultsDone() []FaultDone {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := append([]FaultDone(nil), c.done...)
	sort.Slice(out, func(i, j int) bool { return out[i].Start < out[j].Start })
	return out
}

// checkFaults: every planned fault ran without error.
func (c *chaos) checkFaults(r *ChaosReport, schedule []Fault) {
	want, got := map[string]int{}, map[string]int{}
	var errs []string
	for _, f := range schedule {
		want[f.Kind]++
	}
	for _, f := range r.Done {
		if f.Err != "" {
			errs = append(errs, f.String()+": "+f.Err)
			continue
		}
		got[f.Kind]++
	}
	ok := len(errs) == 0
	for k, n := range want {
		ok = ok && got[k] == n
	}
	r.check("every planned fault happened", ok,
		"%d SIGKILLs of services, %d of the broker, %d PostgreSQL restarts (-m fast %d, -m immediate %d), %d poison batches; errors: %s",
		got[FaultKill], got[FaultBroker], got[FaultPGFast]+got[FaultPGImmediate], got[FaultPGFast], got[FaultPGImmediate], got[FaultPoison], listOr(errs, "none"))
}
