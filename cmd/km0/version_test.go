package main

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/buildinfo"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/kafka/kafkaembed"
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

// `km0 relay --metrics-addr` serves the probe path of the relay's
// Deployment (deploy/kubernetes/relay.yaml) beside /metrics: 200 with the
// relay's name, "ok" and the version.
func TestRelayServesItsProbePathBesideMetrics(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	b := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{"comandes.esdeveniments"}})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	stop := startRelay(t, "--schema", s.Name, "--brokers", strings.Join(b.Addrs(), ","),
		"--topic", "comandes.esdeveniments", "--origin", "comandes", "--metrics-addr", addr)
	get := func(path string) (int, []byte) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, nil
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, body
	}
	var code int
	var body []byte
	testkit.Eventually(t, 20*time.Second, "the relay's "+relayHealthPath, func() bool {
		code, body = get(relayHealthPath)
		return code != 0
	})

	var h system.Health
	if err := json.Unmarshal(body, &h); err != nil || code != http.StatusOK || h.Service != "relay" || h.State != "ok" || h.Version != buildinfo.Read().Short() {
		t.Fatalf("GET %s: %d %s (%v), want 200 relay ok with the version", relayHealthPath, code, body, err)
	}
	if code, _ := get("/metrics"); code != http.StatusOK {
		t.Fatalf("GET /metrics: %d, want 200", code)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
