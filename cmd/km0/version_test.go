package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// `km0 version` of a binary built as deploy/Dockerfile builds it (version
// and commit given at link time) prints the module, that version, that
// commit and the Go version, one aligned row each.
func TestVersionCommandPrintsModuleVersionCommitAndGo(t *testing.T) {
	t.Parallel()
	const version, commit = "v9.8.7", "0123456789abcdef0123456789abcdef01234567"
	bin := filepath.Join(t.TempDir(), "km0")
	build := exec.Command("go", "build", "-trimpath", "-o", bin, "-ldflags",
		"-X github.com/km0/km0/internal/buildinfo.version="+version+" -X github.com/km0/km0/internal/buildinfo.commit="+commit, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatalf("km0 version: %v", err)
	}
	rows := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if len(line) < 14 || line[12] != ' ' || line[13] == ' ' {
			t.Fatalf("row %q is not aligned:\n%s", line, out)
		}
		rows[strings.TrimSpace(line[:12])] = strings.TrimSpace(line[12:])
	}
	for key, want := range map[string]string{"module": "github.com/km0/km0", "version": version, "commit": commit, "go": runtime.Version()} {
		if rows[key] != want {
			t.Errorf("%s = %q, want %q in:\n%s", key, rows[key], want, out)
		}
	}
}
