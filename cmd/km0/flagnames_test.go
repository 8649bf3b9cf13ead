package main

import (
	"context"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/km0/km0/internal/cli"
)

// helpOf runs `km0 argv... --help` in-process and returns what it printed.
func helpOf(t *testing.T, argv ...string) string {
	t.Helper()
	return captureStderr(t, func() { _ = commands[argv[0]].run(context.Background(), append(argv[1:], "--help")) })
}

// flagNames are the flags a --help lists.
func flagNames(help string) []string {
	var names []string
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(help, -1) {
		names = append(names, m[1])
	}
	return names
}

// Every command's --help spells a listen address one way (--http-addr for
// the command's own HTTP server, --console-addr, --kafka-addr,
// --embedded-kafka-addr), lists no old spelling, names its flags in
// English, and --authorize says why its default differs between km0 demo
// and km0 up/serve.
//
// Not parallel: captureStderr swaps os.Stdout and os.Stderr of the whole test
// binary.
func TestHelpSpellsFlagsOneWay(t *testing.T) {
	argvs := [][]string{}
	for name := range commands {
		argvs = append(argvs, []string{name})
	}
	for _, sub := range []string{"ls", "show", "replay", "purge", "index", "sequence"} {
		argvs = append(argvs, []string{"dlq", sub})
	}
	argvs = append(argvs, []string{"serve", "cataleg"})
	want := map[string][]string{
		"up":            {"http-addr", "console-addr", "embedded-kafka-addr"},
		"serve cataleg": {"http-addr", "console-addr"},
		"demo":          {"console-addr"},
		"relay":         {"http-addr"},
		"kafka":         {"kafka-addr"},
		"console":       {"http-addr"},
		"dlq index":     {"http-addr"},
		"dlq ls":        {"state", "reason"},
	}
	old := []string{"http", "console", "metrics-addr", "addr", "estat", "motiu"}
	catalan := regexp.MustCompile(`(^|-)(estat|motiu|comanda|comandes|sequencia|cap|grup|consumidor|esdeveniment|tipus|origen|desti|reproduir|purgar)(-|$)`)
	for _, argv := range argvs {
		cmd := strings.Join(argv, " ")
		names := flagNames(helpOf(t, argv...))
		if len(names) == 0 && argv[0] != "version" && argv[0] != "bench" && argv[0] != "dlq" && argv[0] != "outbox" && argv[0] != "schema" && argv[0] != "serve" {
			t.Errorf("km0 %s --help lists no flags", cmd)
		}
		for _, n := range names {
			if slices.Contains(old, n) {
				t.Errorf("km0 %s --help lists the old spelling --%s", cmd, n)
			}
			if strings.HasSuffix(n, "addr") && !strings.HasSuffix(n, "-addr") || strings.HasSuffix(n, "-address") {
				t.Errorf("km0 %s: --%s is not spelled --<server>-addr", cmd, n)
			}
			if catalan.MatchString(n) {
				t.Errorf("km0 %s: --%s is not English", cmd, n)
			}
		}
		for _, n := range want[cmd] {
			if !slices.Contains(names, n) {
				t.Errorf("km0 %s --help lacks --%s (has %v)", cmd, n, names)
			}
		}
	}
	for _, argv := range [][]string{{"demo"}, {"up"}, {"serve", "cataleg"}} {
		h := helpOf(t, argv...)
		i := strings.Index(h, "  -authorize\n")
		if i < 0 || !strings.Contains(h[i:], "km0 demo") || !strings.Contains(h[i:], "km0 up and km0 serve") {
			t.Errorf("km0 %s --help: --authorize does not say how its default differs between demo and up/serve", strings.Join(argv, " "))
		}
	}
}

// The old spelling of a renamed flag still sets the new one, and --help
// does not list it.
//
// Not parallel: captureStderr swaps os.Stdout and os.Stderr of the whole test
// binary.
func TestOldFlagNamesAreHiddenAliases(t *testing.T) {
	for _, c := range []struct{ cmd, old, name string }{
		{"up", "http", "http-addr"}, {"up", "console", "console-addr"}, {"serve cataleg", "http", "http-addr"},
		{"demo", "console", "console-addr"}, {"relay", "metrics-addr", "http-addr"}, {"kafka", "addr", "kafka-addr"},
		{"dlq ls", "estat", "state"}, {"dlq ls", "motiu", "reason"},
	} {
		fs := cli.NewFlags(c.cmd, "test")
		v := fs.String(c.name, "", "the new name")
		if err := cli.ParseFlags(fs, []string{"--" + c.old, "x:1"}); err != nil || *v != "x:1" {
			t.Errorf("km0 %s --%s x:1: %v, --%s = %q", c.cmd, c.old, err, c.name, *v)
		}
		out := captureStderr(t, func() { fs.SetOutput(nil); fs.Usage() })
		if slices.Contains(flagNames(out), c.old) || !slices.Contains(flagNames(out), c.name) {
			t.Errorf("km0 %s --help lists %v", c.cmd, flagNames(out))
		}
	}
}
