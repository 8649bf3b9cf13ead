package main

import "github.com/km0/km0/internal/bench"

func init() {
	register(&command{name: "bench", summary: "measure km0: bench <name> prints one JSON line per result", run: bench.Run})
}
