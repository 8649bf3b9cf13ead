package main

// TEMPORARY (amqp helper): a minimal bench registry so that bench_rpc.go
// builds before the relay helper's cmd/km0/bench.go is merged. The lead keeps
// the relay helper's version of this file; emit and round2 have the same
// signatures there.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
)

var benches = map[string]func(ctx context.Context, args []string) error{}

// registerBench adds `km0 bench <name>`.
func registerBench(name string, fn func(ctx context.Context, args []string) error) {
	if _, dup := benches[name]; dup {
		panic("km0: bench registered twice: " + name)
	}
	benches[name] = fn
}

func init() {
	register(&command{name: "bench", summary: "run a benchmark, printing one JSON line per result", run: runBench})
}

func runBench(ctx context.Context, args []string) error {
	names := make([]string, 0, len(benches))
	for n := range benches {
		names = append(names, n)
	}
	sort.Strings(names)
	if len(args) == 0 || benches[args[0]] == nil {
		fmt.Fprintf(os.Stderr, "usage: km0 bench %s [flags]\n", strings.Join(names, "|"))
		return errUsage
	}
	return benches[args[0]](ctx, args[1:])
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

// round2 rounds for printing.
func round2(f float64) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(f, 'f', 2, 64), 64)
	return v
}
