package main

// TEMPORARY (consumer helper): a minimal bench registry so that
// bench_consume.go builds before the relay helper's cmd/km0/bench.go is
// merged. The lead keeps the relay helper's version of this file.

import (
	"context"
	"fmt"
	"os"
	"sort"
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
