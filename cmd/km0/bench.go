package main

import (
	"context"

	"github.com/km0/km0/internal/bench"
)

func init() {
	register(&command{name: "bench", summary: "measure km0: bench <name> prints one JSON line per result", run: runBench})
}

// runBench is `km0 bench <name>`: the benchmarks are package internal/bench,
// with this binary's flag conventions.
func runBench(ctx context.Context, args []string) error {
	return bench.Run(ctx, bench.Kit{NewFlags: newFlags, Parse: parse, SecretString: secretString,
		DatabaseURLFlag: databaseURLFlag, BrokersFlag: brokersFlag, RequireBrokers: requireBrokers,
		OpenPool: openPool, Logger: logger, ErrUsage: errUsage}, args)
}
