// Package bench is `km0 bench`: the benchmarks of km0, each beside the
// straight port of the reference loop it is compared with, printing one JSON
// line per result. The process benchmarks (bench system, bench relay --mode
// cdc) run the km0 binary itself (os.Executable) with the hidden subcommands
// of this package; the binary only parses `km0 bench` and calls Run.
package bench

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/migrate"
)

// benches are the benchmarks, each registered from its own file
// (relay.go, ...), so that `km0 bench <name>` finds them.
var benches = map[string]func(ctx context.Context, args []string) error{}

// registerBench adds `km0 bench name`. fn parses its own flags from args.
func registerBench(name string, fn func(ctx context.Context, args []string) error) {
	if _, dup := benches[name]; dup {
		panic("km0: bench registered twice: " + name)
	}
	benches[name] = fn
}

// Names returns the benchmarks' names, sorted.
func Names() []string {
	names := make([]string, 0, len(benches))
	for n := range benches {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Run runs `km0 bench args...` with the binary's flag conventions (package
// internal/cli): args[0] names the benchmark, the rest are its flags.
// Without a name it prints the usage and returns cli.ErrUsage.
func Run(ctx context.Context, args []string) error {
	names := Names()
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprintf(os.Stderr, "usage: km0 bench <%s> [flags]   (km0 bench <name> --help for its flags)\n", strings.Join(names, "|"))
		if len(args) == 0 {
			return cli.ErrUsage
		}
		return nil
	}
	fn, ok := benches[args[0]]
	if !ok {
		fmt.Fprintf(os.Stderr, "km0 bench: unknown benchmark %q (have: %s)\n", args[0], strings.Join(names, ", "))
		return cli.ErrUsage
	}
	return fn(ctx, args[1:])
}

// benchDatabaseURL is the --database-url default of benchmarks:
// KM0_DATABASE_URL, else the machine's local server.
func benchDatabaseURL() string {
	if u := os.Getenv("KM0_DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// emit prints one benchmark result as a JSON line on stdout.
func emit(result map[string]any) {
	b, err := json.Marshal(result)
	if err != nil {
		fmt.Fprintf(os.Stderr, "km0 bench: %v\n", err)
		return
	}
	fmt.Println(string(b))
}

// benchSchema is a throwaway schema with km0's migrations, dropped by drop.
type benchSchema struct {
	Names migrate.Names
	pool  *pgxpool.Pool
}

func newBenchSchema(ctx context.Context, pool *pgxpool.Pool, sets ...migrate.Set) (*benchSchema, error) {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	names := migrate.Names{Schema: "km0_bench_" + hex.EncodeToString(b)}.WithDefaults()
	if _, err := migrate.Up(ctx, pool, names, sets...); err != nil {
		return nil, err
	}
	return &benchSchema{Names: names, pool: pool}, nil
}

func (s *benchSchema) drop() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := s.pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{s.Names.Schema}.Sanitize()+" CASCADE"); err != nil {
		fmt.Fprintf(os.Stderr, "km0 bench: drop schema %s: %v\n", s.Names.Schema, err)
	}
}

// meter measures this process's CPU time and peak resident memory between
// start and stop (RSS sampled every 20 ms).
type meter struct {
	cpu0  time.Duration
	start time.Time
	stopc chan struct{}
	wg    sync.WaitGroup
	peak  int64
}

func startMeter() *meter {
	m := &meter{cpu0: cpuTime(), start: time.Now(), stopc: make(chan struct{})}
	m.peak = rssBytes()
	m.wg.Go(func() {
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-m.stopc:
				return
			case <-t.C:
				m.peak = max(m.peak, rssBytes())
			}
		}
	})
	return m
}

// stop returns the elapsed time, the CPU time used and the peak RSS in MB.
func (m *meter) stop() (elapsed, cpu time.Duration, rssMB float64) {
	elapsed = time.Since(m.start)
	close(m.stopc)
	m.wg.Wait()
	m.peak = max(m.peak, rssBytes())
	return elapsed, cpuTime() - m.cpu0, float64(m.peak) / (1 << 20)
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// rssBytes reads VmRSS from /proc/self/status (0 where there is no procfs).
func rssBytes() int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// cpuProfileFlag registers --cpuprofile; start begins profiling if it was
// given and returns the function that stops it.
func cpuProfileFlag(fs *flag.FlagSet) (start func() (stop func(), err error)) {
	path := fs.String("cpuprofile", "", "write a CPU profile of the measured run to this file")
	return func() (func(), error) {
		if *path == "" {
			return func() {}, nil
		}
		f, err := os.Create(*path)
		if err != nil {
			return nil, err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return nil, err
		}
		return func() { pprof.StopCPUProfile(); f.Close() }, nil
	}
}

// round2 rounds for printing.
func round2(f float64) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(f, 'f', 2, 64), 64)
	return v
}
