// Command km0 runs km0: the embedded broker, migrations, the relay, consumers,
// the Quilòmetre Zero services, the demo, DLQ tools and benchmarks.
//
// Each subcommand lives in its own file and registers itself in init.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"sort"
	"syscall"

	"github.com/km0/km0/internal/cli"
)

// command is one subcommand.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string) error
}

var commands = map[string]*command{}

func register(c *command) {
	if _, dup := commands[c.name]; dup {
		panic("km0: command registered twice: " + c.name)
	}
	commands[c.name] = c
}

// errUsage makes main exit 2 without printing the error again.
var errUsage = cli.ErrUsage

func usage() {
	fmt.Fprintln(os.Stderr, "usage: km0 <command> [flags]   (km0 <command> --help for its flags)")
	fmt.Fprintln(os.Stderr, "\ncommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-10s %s\n", n, commands[n].summary)
	}
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	c, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "km0: unknown command %q\n", os.Args[1])
		usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal asks for a clean stop; once it has arrived, the
	// default action is back, so a second Ctrl-C ends a slow shutdown at once.
	go func() { <-ctx.Done(); stop() }()
	stopProfile := profileFromEnv(c.name)
	err := c.run(ctx, os.Args[2:])
	stopProfile()
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
	case errors.Is(err, cli.ErrUsage):
		os.Exit(2)
	default:
		fmt.Fprintf(os.Stderr, "km0 %s: %v\n", c.name, err)
		os.Exit(1)
	}
}

// profileFromEnv writes a CPU profile of the whole command to
// $KM0_CPUPROFILE.<command>.<pid> if KM0_CPUPROFILE is set (a hidden knob for
// profiling the processes that benchmarks spawn, which inherit it); it
// returns the function that stops it. Errors are printed and ignored.
func profileFromEnv(name string) (stop func()) {
	prefix := os.Getenv("KM0_CPUPROFILE")
	if prefix == "" {
		return func() {}
	}
	f, err := os.Create(fmt.Sprintf("%s.%s.%d", prefix, name, os.Getpid()))
	if err == nil {
		err = pprof.StartCPUProfile(f)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "km0: KM0_CPUPROFILE: %v\n", err)
		return func() {}
	}
	return func() { pprof.StopCPUProfile(); f.Close() }
}
