package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"

	"github.com/km0/km0/internal/buildinfo"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
)

func init() {
	register(&command{name: "version", summary: "print the module version, the commit and the Go version of this binary", run: runVersion})
}

func runVersion(_ context.Context, args []string) error {
	fs := flag.NewFlagSet("version", flag.ContinueOnError)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "km0 version: unexpected argument %q\n", fs.Arg(0))
		return cli.ErrUsage
	}
	printVersion(os.Stdout, buildinfo.Read())
	return nil
}

// printVersion writes in as an aligned table.
func printVersion(w io.Writer, in buildinfo.Info) {
	modified := "no"
	if in.Modified {
		modified = "yes"
	}
	for _, row := range [][2]string{
		{"module", in.Module}, {"version", in.Version}, {"commit", in.Commit},
		{"commit time", in.Time}, {"modified", modified}, {"go", in.GoVersion},
	} {
		fmt.Fprintf(w, "%-12s %s\n", row[0], row[1])
	}
}

// relayHealthPath is the liveness probe `km0 relay --metrics-addr` serves
// beside /metrics: 200 with the body of system.HealthPath while the process
// runs (the relay retries a lost database or broker by itself; its lag
// metrics tell whether it keeps up).
const relayHealthPath = system.HealthPath

func relayHealth() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		svc.WriteJSON(w, http.StatusOK, system.Health{Service: "relay", State: "ok", Version: buildinfo.Read().Short()})
	})
}
