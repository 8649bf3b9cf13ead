package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"

	"github.com/km0/km0/internal/pgtest"
)

// tourBlocks are the ```sh blocks of docs/tour.md, in order.
func tourBlocks(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../../docs/tour.md")
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	for _, m := range regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(string(b), -1) {
		blocks = append(blocks, m[1])
	}
	return blocks
}

// The tour of docs/tour.md works as written: its sh blocks run in order in
// one bash (set -e), as a reader pastes them, with only these changes so
// that it can run beside other tests: free ports for 9092, 8080 and 8090, a
// database suffix of its own for "tour", and ./km0 the test binary (instead
// of go build). What each step prints is checked.
func TestTourRunsAsWritten(t *testing.T) {
	t.Parallel()
	blocks := tourBlocks(t)
	if len(blocks) != 7 {
		t.Fatalf("docs/tour.md has %d sh blocks, want 7 (the test checks each step's output)", len(blocks))
	}
	suffix := fmt.Sprintf("tour_%d", os.Getpid())
	t.Cleanup(func() {
		for _, name := range append(system.Services[:len(system.Services):len(system.Services)], "dlq") {
			_ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName(name, suffix))
		}
	})
	build := "go build -o km0 ./cmd/km0"
	if !strings.HasPrefix(blocks[0], build) {
		t.Fatalf("the tour's first command is not %q:\n%s", build, blocks[0])
	}
	dir := t.TempDir()
	shim := fmt.Sprintf("#!/bin/sh\n%s=1 exec %q \"$@\"\n", runMainEnv, km0Bin(t))
	if err := os.WriteFile(filepath.Join(dir, "km0"), []byte(shim), 0o755); err != nil {
		t.Fatal(err)
	}
	script := "set -e\n" + strings.Join(blocks, "\n")
	script = strings.Replace(script, build, "true", 1)
	for _, old := range []string{"127.0.0.1:9092", "127.0.0.1:8080", "127.0.0.1:8090"} {
		script = strings.ReplaceAll(script, old, freeAddr(t))
	}
	script = regexp.MustCompile(`(--database-suffix |_)tour\b`).ReplaceAllString(script, "${1}"+suffix) // km0_<service>_tour
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)                             // bounds a hang only
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-c", script)
	cmd.Dir = dir
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KM0_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // the background km0 up goes with it
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	log, _ := os.ReadFile(filepath.Join(dir, "km0-up.out"))
	if err != nil {
		t.Fatalf("the tour failed: %v\n%s\nkm0 up's output:\n%s", err, out.String(), log)
	}
	t.Logf("the tour's output:\n%s", out.String())
	rest := out.String()
	for _, want := range []string{
		"km0 up: running comandes, inventari, pagaments, repartiment, analitica, cataleg", // 1
		`"estat":"creada"`, `"capacitat":"`, `"client":"anna"`, // 2
		`"estat":"cancellada","motiu":"client"`,                                                               // 3
		`"id":"P-2026-000002","estat":"creada"`, "comandes.esdeveniments.dlq", "permanent: estoc_insuficient", // 4
		"comandes", "inventari.descompte_estoc", // 5
		`estoc_insuficient`, // 6: the letter through the admin API
	} {
		i := strings.Index(rest, want)
		if i < 0 {
			t.Fatalf("the tour's output lacks %q where expected:\n%s", want, out.String())
		}
		rest = rest[i+len(want):]
	}
	if !strings.Contains(string(log), "km0 up: stopping") {
		t.Errorf("km0 up did not stop cleanly on kill %%1:\n%s", log)
	}
}
