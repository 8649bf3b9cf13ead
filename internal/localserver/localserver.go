// Package localserver holds what the kits that run a local server process
// (internal/pgcluster, internal/pgbouncer) share: a free loopback port and a
// stop that signals, waits, then kills.
package localserver

import (
	"fmt"
	"net"
	"os"
	"time"
)

// FreePort returns a TCP port of 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// Stop sends sig to p and waits for its exit on done (the result of its
// Wait) for up to grace; then it kills p and waits for the exit anyway.
func Stop(p *os.Process, sig os.Signal, done <-chan error, grace time.Duration) {
	_ = p.Signal(sig)
	select {
	case <-done:
	case <-time.After(grace):
		_ = p.Kill()
		<-done
	}
}
