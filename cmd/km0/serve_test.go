package main

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// runMainEnv makes the test binary run km0's main instead of the tests
// (KM0_TEST_KM0_RACE=1 starts it as km0; a process km0 starts from its own
// executable then is this binary too).
const runMainEnv = "KM0_TEST_RUN_MAIN"

// An init, not TestMain, so that it runs before any test code; it runs after
// the inits of the non-test files, which register the commands.
func init() {
	if os.Getenv(runMainEnv) == "1" {
		main()
		os.Exit(0)
	}
}

func TestMain(m *testing.M) {
	// The tests' brokers are one-node kfakes: the topics km0 processes and
	// the commands run in-process create take replication factor 1 (the
	// default 3 is refused by one node; TestRelayDefaultReplicationFactor).
	if os.Getenv(replicationFactorEnv) == "" {
		_ = os.Setenv(replicationFactorEnv, "1")
	}
	if os.Getenv(raceChildrenEnv) == "1" && !strings.Contains(os.Getenv("GORACE"), "atexit_sleep_ms") {
		_ = os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	}
	// Most tests here wait on km0 processes, brokers and PostgreSQL rather
	// than compute: run more of them at once than -test.parallel's default
	// (GOMAXPROCS, 2 on a small machine), unless the flag is given.
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		_ = flag.Set("test.parallel", strconv.Itoa(max(runtime.GOMAXPROCS(0), parallelDefault)))
	}
	os.Exit(runWithKm0(m))
}

// runWithKm0 runs the tests and removes the km0 binary km0Bin built, if
// any.
func runWithKm0(m *testing.M) int {
	code := m.Run()
	if dir := builtDir.Load(); dir != nil {
		_ = os.RemoveAll(*dir)
	}
	return code
}

// raceChildrenEnv set to 1 makes the tests start this race-built test
// binary as km0 instead of a plain build of the command.
const raceChildrenEnv = "KM0_TEST_KM0_RACE"

// builtDir is the directory of the km0 binary km0Bin built.
var builtDir atomic.Pointer[string]

// buildKm0 builds the km0 binary once, for the first test that starts one.
var buildKm0 = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "km0-cmd-test-")
	if err != nil {
		return "", err
	}
	builtDir.Store(&dir)
	bin := filepath.Join(dir, "km0")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		return "", fmt.Errorf("building the km0 binary the tests start: %v\n%s", err, out)
	}
	return bin, nil
})

// km0Bin is the km0 binary the tests start: the command as users build it,
// without the race detector (built once, by the first test that asks). The
// code it runs is raced in-process by the tests of its packages, and
// race-built processes took a third of this package's CPU.
// KM0_TEST_KM0_RACE=1 makes it this race-built test binary instead, which
// runs km0's main with KM0_TEST_RUN_MAIN=1 (the starters set it) and with
// atexit_sleep_ms=0 (else each process would sleep a second at exit); a
// race it hits still fails the test (exit 66).
func km0Bin(t testing.TB) string {
	t.Helper()
	if os.Getenv(raceChildrenEnv) == "1" {
		return os.Args[0]
	}
	bin, err := buildKm0()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// parallelDefault is how many parallel tests of this package run at once
// when -test.parallel is not given.
const parallelDefault = 8

// replicationFactorEnv is the environment fallback of --kafka-replication-factor.
const replicationFactorEnv = "KM0_KAFKA_REPLICATION_FACTOR"

// proc is a km0 process started by a test.
type proc struct {
	cmd     *exec.Cmd
	running chan struct{} // closed when it printed "running"
	exited  chan struct{} // closed when it exited; then err is set
	err     error
	mu      sync.Mutex
	stderr  bytes.Buffer
	stdout  bytes.Buffer
}

func (p *proc) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.String()
}

// output is what p printed on stdout so far.
func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stdout.String()
}

type lockedWriter struct{ p *proc }

func (w lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.stderr.Write(b)
}

// startKm0 runs `km0 args...` as its own process with env added to the
// environment (without KM0_DATABASE_URL and KM0_KAFKA_BROKERS of the test's
// own environment); it is SIGKILLed at cleanup if still running.
func startKm0(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(km0Bin(t), args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KM0_DATABASE_URL=") && !strings.HasPrefix(kv, "KM0_KAFKA_BROKERS=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(append(cmd.Env, runMainEnv+"=1"), env...)
	p := &proc{cmd: cmd, running: make(chan struct{}), exited: make(chan struct{})}
	cmd.Stderr = lockedWriter{p}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		once := sync.Once{}
		for sc.Scan() {
			p.mu.Lock()
			p.stdout.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
			if strings.Contains(sc.Text(), ": running ") {
				once.Do(func() { close(p.running) })
			}
		}
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.exited
	})
	return p
}

// waitRunning waits until p printed that it runs, failing if it exits first.
func (p *proc) waitRunning(t *testing.T, within time.Duration) {
	t.Helper()
	select {
	case <-p.running:
	case <-p.exited:
		t.Fatalf("km0 exited before running: %v\n%s", p.err, p.log())
	case <-time.After(within):
		t.Fatalf("km0 not running after %v\n%s", within, p.log())
	}
}

// waitGroup polls the consumer group until ok accepts its description.
func waitGroup(t *testing.T, adm *kadm.Client, group, what string, ok func(kadm.DescribedGroup) bool) {
	t.Helper()
	testkit.Eventuallyf(t, 30*time.Second, "group "+group+" "+what, func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		gs, err := adm.DescribeGroups(ctx, group)
		cancel()
		if err == nil {
			if g, found := gs[group]; found && g.Err == nil && ok(g) {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%v %+v", err, gs[group])
	})
}

// `km0 serve NAME` stops within the documented grace on SIGTERM, with no
// worker left behind, even when it stops during a rebalance that waits for a
// member that died without leaving: the first process of the service is
// SIGKILLed once its consumer group is stable, a second one is started, and
// it is sent SIGTERM while its JoinGroup waits for the dead member (the
// group is PreparingRebalance). Each service, on a database of its own.
//
// The services' subtests run at once from goroutines of their own (t.Run
// allows it) rather than as parallel subtests: those would wait for a
// parallel slot behind every other test of the package, and their waits for
// a rebalance would end the run alone.
func TestServeStopsWithinTheGraceWhileARebalanceWaitsForADeadMember(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, system.DomainTopics()...)
	adm := kadm.NewClient(kafkatest.Client(t, b))
	sem := make(chan struct{}, 3) // processes at once: the machine is small
	var wg sync.WaitGroup
	defer wg.Wait()
	for i, service := range system.Services {
		group := system.ConsumerNames[i]
		wg.Add(1)
		go func() {
			defer wg.Done()
			t.Run(service, func(t *testing.T) { serveStopsWithinTheGrace(t, sem, adm, b, service, group) })
		}()
	}
}

// serveStopsWithinTheGrace is the subtest of service, whose consumer group
// is group, for TestServeStopsWithinTheGraceWhileARebalanceWaitsForADeadMember.
func serveStopsWithinTheGrace(t *testing.T, sem chan struct{}, adm *kadm.Client, b *kafkaembed.Broker, service, group string) {
	sem <- struct{}{}
	defer func() { <-sem }()
	env := []string{serviceDatabaseEnv(service) + "=" + pgtest.NewDatabase(t), testSigningKeyEnv}
	args := []string{"serve", service, "--brokers", strings.Join(b.Addrs(), ",")}
	first := startKm0(t, env, args...)
	first.waitRunning(t, 60*time.Second)
	waitGroup(t, adm, group, "stable with one member", func(g kadm.DescribedGroup) bool {
		return g.State == "Stable" && len(g.Members) == 1
	})
	if err := first.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-first.exited
	second := startKm0(t, env, args...)
	second.waitRunning(t, 60*time.Second)
	waitGroup(t, adm, group, "rebalancing", func(g kadm.DescribedGroup) bool { return g.State == "PreparingRebalance" })
	start := time.Now()
	if err := second.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-second.exited:
	case <-time.After(system.ShutdownGraceDefault + 5*time.Second):
		t.Fatalf("km0 serve %s still running %v after SIGTERM\n%s", service, time.Since(start), second.log())
	}
	took := time.Since(start)
	log := second.log()
	if second.err != nil || took > system.ShutdownGraceDefault || strings.Contains(log, "leaving them behind") {
		t.Fatalf("km0 serve %s: exit %v after %v (grace %v)\n%s", service, second.err, took, system.ShutdownGraceDefault, log)
	}
	t.Logf("km0 serve %s stopped %v after SIGTERM", service, took.Round(time.Millisecond))
}

// Renames that are malformed, of names the contract does not have, or into
// names Kafka refuses are refused before anything is connected, naming the
// flag or the name; a service without any database is refused naming its
// variable. The context only bounds a hang.
//
// Not parallel: t.Setenv, for the environment runServe (the database URLs)
// reads in this process.
func TestServeRefusesBadRenamesAndAMissingDatabase(t *testing.T) {
	t.Setenv("KM0_DATABASE_URL", "")
	t.Setenv("KM0_CATALEG_DATABASE_URL", "")
	own := []string{"--service-database-url", "postgres://postgres@127.0.0.1:1/qualsevol", "--brokers", "127.0.0.1:1"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{append([]string{"--topics", "inventari.esdeveniments"}, own...), "--topics"},
		{append([]string{"--groups", "=x"}, own...), "--groups"},
		{append([]string{"--topics", "a=x,a=y"}, own...), "renamed twice"},
		{append([]string{"--topics", "inventari.events=x"}, own...), `unknown topic "inventari.events"`},
		{append([]string{"--topics", "inventari.esdeveniments=a/b"}, own...), "a topic name is"},
		{append([]string{"--groups", "cataleg.flags=x"}, own...), `unknown consumer group "cataleg.flags"`},
		{[]string{"--brokers", "127.0.0.1:1"}, "KM0_CATALEG_DATABASE_URL"},
		{append([]string{"--database-suffix", "chaos; DROP"}, own...), "--database-suffix"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := runServe(ctx, append([]string{"cataleg"}, c.args...))
		cancel()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("km0 serve cataleg %s: want an error with %q, got %v", strings.Join(c.args, " "), c.want, err)
		}
	}
}

// A comandes process SIGKILLed in the middle of a POST with an
// Idempotency-Key (it had claimed the key and was waiting for pagaments to
// authorise the order: pagaments was not running) does not leave the key stuck:
// once comandes is back (and pagaments is up), a retry with the key is
// answered 201 within the key's lease, and the order exists once.
func TestServeComandesRetryAfterACrashMidRequestGetsItsOrderOnce(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, system.DomainTopics()...)
	comandesDB, pagamentsDB := pgtest.NewDatabase(t), pgtest.NewDatabase(t)
	addr := freeAddr(t)
	brokers := strings.Join(b.Addrs(), ",")
	env := []string{serviceDatabaseEnv("comandes") + "=" + comandesDB, serviceDatabaseEnv("pagaments") + "=" + pagamentsDB, testSigningKeyEnv}
	args := []string{"serve", "comandes", "--authorize", "--brokers", brokers, "--http", "comandes=" + addr}
	const key, body = "clau-caiguda", `{"id":"P-2026-000777","client":"anna","mercat":"vic","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":300}]}`
	post := func(ctx context.Context) (int, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/comandes", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	first := startKm0(t, env, args...)
	first.waitRunning(t, 60*time.Second)
	go func() { _, _ = post(context.Background()) }() // never answered: the process dies under it
	pool := pgtest.NewPool(t, comandesDB, 1)
	testkit.Eventuallyf(t, 30*time.Second, "the key claimed (the request waiting for its authorisation)", func() (bool, string) {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM peticions_idempotents WHERE clau = $1 AND estat_http = 0`, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1, first.log()
	})
	if err := first.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-first.exited
	pagaments := startKm0(t, env, "serve", "pagaments", "--brokers", brokers)
	pagaments.waitRunning(t, 60*time.Second)
	second := startKm0(t, env, args...)
	second.waitRunning(t, 60*time.Second)
	// The retry waits for the dead request's lease, then runs afresh; a
	// client retries a 503 (pagaments still joining its group) as told.
	ctx, cancel := context.WithTimeout(context.Background(), 2*comandes.KeyLeaseDefault+30*time.Second)
	defer cancel()
	for {
		status, err := post(ctx)
		if err == nil && status == http.StatusCreated {
			break
		}
		if ctx.Err() != nil || (err == nil && status != http.StatusServiceUnavailable) {
			t.Fatalf("retry: %d %v\n%s", status, err, second.log())
		}
		time.Sleep(100 * time.Millisecond) // the client's pause between retries
	}
	var orders, events int
	if err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM comandes), (SELECT count(*) FROM outbox)`).Scan(&orders, &events); err != nil {
		t.Fatal(err)
	}
	if orders != 1 || events != 1 {
		t.Fatalf("%d orders and %d events, want 1 and 1", orders, events)
	}
}
