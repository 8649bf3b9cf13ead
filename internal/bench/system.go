package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

func init() {
	registerBench("system", benchSystem)
}

// systemSections are the parts of `km0 bench system`, in run order.
var systemSections = []string{"relay", "inventari", "pagaments"}

// systemExtras are parts of `km0 bench system` run only when --only names
// them: relay-cdc starts a private PostgreSQL cluster of its own.
var systemExtras = []string{"relay-cdc"}

// Hidden subcommands of `km0 bench system`: the straight ports of the
// reference Python loops (polling relay, idempotent consumer, request/reply server), run as processes of their own beside km0's (the first
// argument selects them; they are not listed in --help).
var systemPorts = map[string]func(ctx context.Context, args []string) error{
	"_port-relay":     runPortRelayProcess,
	"_port-inventari": runPortInventariProcess,
	"_port-pagaments": runPortPagamentsProcess,
}

// benchSystem runs km0 as a user runs it (the km0 binary with its defaults,
// the broker in another process over TCP, PostgreSQL with fsync on, the
// contract's workload), each part beside a straight port of the reference loop in
// the same run, and prints the ratios. Every process it starts is stopped and
// every database it creates is dropped when it returns (also on Ctrl-C).
func benchSystem(ctx context.Context, args []string) error {
	if len(args) > 0 {
		if port, ok := systemPorts[args[0]]; ok {
			return port(ctx, args[1:])
		}
	}
	fs := cli.NewFlags("bench system", "run the km0 binary's relay, inventari and pagaments as a user does, each beside a Go port of the reference Python loop, and print the ratios; one JSON line per result")
	dbURL := cli.SecretString(fs, "database-url", benchDatabaseURL(), "PostgreSQL admin URL (default $KM0_DATABASE_URL, else the local server); fresh databases km0_bench_* are created on its server and dropped")
	amqpURL := cli.SecretString(fs, "amqp-url", cmpOr(os.Getenv("KM0_AMQP_URL"), amqp.URLDefault), "RabbitMQ URL for pagaments (default $KM0_AMQP_URL, else the local guest broker)")
	only := fs.String("only", strings.Join(systemSections, ","), "comma-separated parts to run: relay, inventari, pagaments; and, only when named, relay-cdc (km0 relay --mode cdc beside the polling relay and the port, on a private cluster with wal_level = logical started from "+pgcluster.BinDirDefault+")")
	n := fs.Int("n", 50_000, "relay: outbox rows; inventari: comanda.creada events")
	rounds := fs.Int("rounds", 3, "rounds; km0 and the port alternate which goes first")
	cheese := fs.Bool("cheese-runs-out", false, "inventari: do not restock the cheeses (formatge-curat, formatge-fresc), so most of their orders are refused")
	portOutbox := fs.Bool("port-outbox", true, "inventari: the port also writes estoc.actualitzat to its outbox per line, as km0 does")
	rrSerial := fs.Int("rr-serial", 2_000, "pagaments: requests of the 1-caller phase")
	rrRequests := fs.Int("rr-requests", 20_000, "pagaments: requests of the 64-caller phase")
	rrCallers := fs.Int("rr-callers", 64, "pagaments: callers of the concurrent phase")
	peerWorkers := fs.Int("peer-workers", 16, "pagaments: handler goroutines of the plain amqp091-go server (amqprr's default)")
	timeout := fs.Duration("timeout", 30*time.Minute, "give up on one side of one round after this long")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	var sections []string
	for _, s := range strings.Split(*only, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		if !slices.Contains(systemSections, s) && !slices.Contains(systemExtras, s) {
			return fmt.Errorf("--only %q: want a comma-separated list of %s", s, strings.Join(append(slices.Clone(systemSections), systemExtras...), ", "))
		}
		sections = append(sections, s)
	}
	switch {
	case len(sections) == 0:
		return errors.New("--only names no part")
	case *n <= 0 || *rounds <= 0 || *rrSerial <= 0 || *rrRequests <= 0 || *rrCallers <= 0 || *peerWorkers <= 0:
		return errors.New("--n, --rounds, --rr-serial, --rr-requests, --rr-callers and --peer-workers must be positive")
	case *timeout <= 0:
		return errors.New("--timeout must be positive")
	}
	b, err := newSysBench(ctx, *dbURL, *amqpURL, *timeout)
	if err != nil {
		return err
	}
	defer b.close()
	for _, s := range sections {
		var err error
		switch s {
		case "relay":
			err = b.relay(ctx, *n, *rounds)
		case "relay-cdc":
			err = b.relayCDC(ctx, *n, *rounds)
		case "inventari":
			err = b.inventari(ctx, *n, *rounds, *cheese, *portOutbox)
		case "pagaments":
			err = b.pagaments(ctx, *rounds, rrConfig{serial: *rrSerial, requests: *rrRequests, callers: *rrCallers, peerWorkers: *peerWorkers})
		}
		if err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	return nil
}

// sysBench owns what one `km0 bench system` run starts: processes and
// databases, all named with tag.
type sysBench struct {
	admin   string // admin URL of the PostgreSQL server
	amqpURL string
	tag     string
	timeout time.Duration
	exe     string

	mu    sync.Mutex
	procs []*sysProc
	dbs   []string

	flagOnce    sync.Once
	serviceFlag bool // km0 serve takes --service-database-url
}

func newSysBench(ctx context.Context, admin, amqpURL string, timeout time.Duration) (*sysBench, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("cannot find the km0 binary to start: %w", err)
	}
	pool, err := cli.OpenPool(ctx, admin, 1)
	if err != nil {
		return nil, err
	}
	pool.Close()
	tb := make([]byte, 4)
	_, _ = rand.Read(tb)
	return &sysBench{admin: admin, amqpURL: amqpURL, tag: hex.EncodeToString(tb), timeout: timeout, exe: exe}, nil
}

// close stops every process still running and drops every database still
// there.
func (b *sysBench) close() {
	b.mu.Lock()
	procs, dbs := slices.Clone(b.procs), slices.Clone(b.dbs)
	b.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range procs {
		wg.Go(func() { p.stop() })
	}
	wg.Wait()
	for _, name := range dbs {
		b.dropDB(name)
	}
}

// createDB creates database name (it must not exist: a benchmark runs on
// fresh databases) and returns its URL; close drops it.
func (b *sysBench) createDB(ctx context.Context, name string) (string, error) {
	conn, err := pgx.Connect(ctx, b.admin)
	if err != nil {
		return "", fmt.Errorf("connect to %s: %w", redact.URL(b.admin), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	b.mu.Lock()
	b.dbs = append(b.dbs, name)
	b.mu.Unlock()
	return svc.WithDatabase(b.admin, name)
}

// dropDB drops a database createDB made (closing its sessions).
func (b *sysBench) dropDB(name string) {
	b.mu.Lock()
	i := slices.Index(b.dbs, name)
	if i >= 0 {
		b.dbs = slices.Delete(b.dbs, i, i+1)
	}
	b.mu.Unlock()
	if i < 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := svc.DropDatabase(ctx, b.admin, name); err != nil {
		fmt.Fprintf(os.Stderr, "km0 bench system: %v\n", err)
	}
}

// dbName names a database of this run.
func (b *sysBench) dbName(parts ...string) string {
	return "km0_bench_" + b.tag + "_" + strings.Join(parts, "_")
}

// sysProc is a process this run started: the km0 binary with some arguments.
type sysProc struct {
	name  string
	cmd   *exec.Cmd
	out   *tailBuffer
	start time.Time
	done  chan struct{}
	err   error // of Wait, once done is closed

	stopOnce sync.Once
	hwm      int64 // peak RSS in bytes (VmHWM), read just before stop signals
}

// spawn starts the km0 binary with args (and env added to this process's
// environment). The process gets SIGKILL if this one dies, and its own
// process group, so that a Ctrl-C reaches only the benchmark, which stops it.
func (b *sysBench) spawn(name string, env []string, args ...string) (*sysProc, error) {
	cmd := exec.Command(b.exe, args...)
	cmd.Env = append(os.Environ(), env...)
	out := &tailBuffer{max: 64 << 10}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	p := &sysProc{name: name, cmd: cmd, out: out, done: make(chan struct{})}
	p.start = time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	b.mu.Lock()
	b.procs = append(b.procs, p)
	b.mu.Unlock()
	return p, nil
}

// exited returns an error with the end of the process's output if it has
// exited, else nil.
func (p *sysProc) exited() error {
	select {
	case <-p.done:
		return fmt.Errorf("%s exited (%v); its output ends:\n%s", p.name, p.err, p.out.String())
	default:
		return nil
	}
}

// stop sends SIGTERM, waits up to 20 s, then SIGKILL, and returns the
// process's final state.
func (p *sysProc) stop() *os.ProcessState {
	p.stopOnce.Do(func() {
		select {
		case <-p.done:
			return
		default:
		}
		p.hwm = procHWM(p.cmd.Process.Pid)
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(20 * time.Second):
			fmt.Fprintf(os.Stderr, "km0 bench system: %s did not stop in 20 s after SIGTERM; killing it\n", p.name)
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
	<-p.done
	return p.cmd.ProcessState
}

// procUsage stops p and returns its CPU time (rusage) and peak RSS in MB.
// The peak is VmHWM of /proc/<pid>/status read before the stop: rusage's
// ru_maxrss of a child counts the memory of the process it was forked
// from (this one), whatever the child used after exec.
func procUsage(p *sysProc) (cpu time.Duration, rssMB float64) {
	st := p.stop()
	if st != nil {
		cpu = st.UserTime() + st.SystemTime()
	}
	return cpu, float64(p.hwm) / (1 << 20)
}

// procHWM reads VmHWM (peak resident memory) of process pid; 0 if unknown.
func procHWM(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

// waitUntil polls cond every interval until it holds, p exits, ctx ends or
// the run's timeout passes.
func (b *sysBench) waitUntil(ctx context.Context, what string, p *sysProc, interval time.Duration, cond func(ctx context.Context) (bool, error)) error {
	deadline := time.Now().Add(b.timeout)
	for {
		ok, err := cond(ctx)
		if err != nil && ctx.Err() == nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		if ok {
			return nil
		}
		if p != nil {
			if err := p.exited(); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
		}
		if time.Now().After(deadline) {
			msg := ""
			if p != nil {
				msg = "; " + p.name + "'s output ends:\n" + p.out.String()
			}
			return fmt.Errorf("%s: not done after %v (--timeout)%s", what, b.timeout, msg)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(interval):
		}
	}
}

// broker is a `km0 kafka` process on a free port of 127.0.0.1, with a
// client for the benchmark's own use (producing, reading offsets).
type broker struct {
	p     *sysProc
	addr  string
	cl    *kgo.Client
	admin *kadm.Client
}

// startKafka starts `km0 kafka --addr 127.0.0.1:<free port>` and waits until
// it answers.
func (b *sysBench) startKafka(ctx context.Context) (*broker, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := l.Addr().String()
	l.Close()
	p, err := b.spawn("km0 kafka", nil, "kafka", "--addr", addr)
	if err != nil {
		return nil, err
	}
	cl, err := kafka.NewClient([]string{addr})
	if err != nil {
		p.stop()
		return nil, err
	}
	k := &broker{p: p, addr: addr, cl: cl, admin: kadm.NewClient(cl)}
	err = b.waitUntil(ctx, "km0 kafka to answer", p, 20*time.Millisecond, func(ctx context.Context) (bool, error) {
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := k.admin.ListTopics(c)
		return err == nil, nil
	})
	if err != nil {
		k.stop()
		return nil, err
	}
	return k, nil
}

func (k *broker) stop() {
	k.cl.Close()
	k.p.stop()
}

// records returns the number of records in topic (the sum of its end offsets).
func (k *broker) records(ctx context.Context, topic string) (int64, error) {
	ends, err := k.admin.ListEndOffsets(ctx, topic)
	if err != nil {
		return 0, err
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) {
		if o.Err == nil {
			n += o.Offset
		}
	})
	return n, ends.Error()
}

// lag returns how many records of topics group has not committed yet (a
// partition without a committed offset counts from 0).
func (k *broker) lag(ctx context.Context, group string, topics ...string) (int64, error) {
	ends, err := k.admin.ListEndOffsets(ctx, topics...)
	if err != nil {
		return 0, err
	}
	if err := ends.Error(); err != nil {
		return 0, err
	}
	committed, err := k.admin.FetchOffsets(ctx, group)
	if err != nil {
		return 0, err
	}
	var lag int64
	ends.Each(func(o kadm.ListedOffset) {
		at := int64(0)
		if c, ok := committed.Lookup(o.Topic, o.Partition); ok && c.Err == nil && c.At >= 0 {
			at = c.At
		}
		lag += max(o.Offset-at, 0)
	})
	return lag, nil
}

// pctl returns the p-th percentile (0..100) of sorted durations, in ms.
func pctl(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := min(int(float64(len(sorted))*p/100), len(sorted)-1)
	return round2(float64(sorted[i].Microseconds()) / 1000)
}

// ratio is a/b rounded, 0 when b is 0.
func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return round2(a / b)
}

// med2 is the median, rounded for printing.
func med2(xs []float64) float64 { return round2(median(xs)) }

// perSecond is n per d, rounded; 0 when d is not positive.
func perSecond(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return round2(float64(n) / d.Seconds())
}
