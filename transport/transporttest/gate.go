package transporttest

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
)

// errGateDown is what a dial through a closed Gate returns.
var errGateDown = errors.New("transporttest: gate closed (broker unreachable)")

// Gate stands between a publisher and its broker: while it is down, every
// connection through it is cut and new ones fail, as when the broker or the
// network goes away. The broker itself keeps running, so the suite can take
// an external broker "down" without touching it.
//
// A Kafka harness passes DialContext to the client (kgo.Dialer): the brokers'
// metadata names their real addresses, and every dial still goes through the
// gate. An AMQP harness dials the broker through Proxy.
type Gate struct {
	mu    sync.Mutex
	down  bool
	conns map[net.Conn]struct{}
	d     net.Dialer
}

// NewGate returns an open gate.
func NewGate() *Gate { return &Gate{conns: map[net.Conn]struct{}{}} }

// DialContext dials addr unless the gate is down.
func (g *Gate) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	g.mu.Lock()
	down := g.down
	g.mu.Unlock()
	if down {
		return nil, errGateDown
	}
	c, err := g.d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	if !g.track(c) {
		_ = c.Close()
		return nil, errGateDown
	}
	return c, nil
}

// track registers c, or reports false when the gate went down meanwhile.
func (g *Gate) track(c net.Conn) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.down {
		return false
	}
	g.conns[c] = struct{}{}
	return true
}

func (g *Gate) forget(c net.Conn) {
	g.mu.Lock()
	delete(g.conns, c)
	g.mu.Unlock()
}

// Down cuts every connection through the gate and refuses new ones.
func (g *Gate) Down() {
	g.mu.Lock()
	g.down = true
	conns := g.conns
	g.conns = map[net.Conn]struct{}{}
	g.mu.Unlock()
	for c := range conns {
		_ = c.Close()
	}
}

// Up lets connections through again.
func (g *Gate) Up() {
	g.mu.Lock()
	g.down = false
	g.mu.Unlock()
}

// Proxy listens on a free local port and forwards every connection to addr
// through the gate; it returns the address to dial instead of addr. It stops
// at the test's cleanup.
func (g *Gate) Proxy(t testing.TB, addr string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("transporttest: proxy: %v", err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		_ = ln.Close()
		g.Down()
		wg.Wait()
		g.Up()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			if !g.track(in) {
				_ = in.Close()
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer g.forget(in)
				defer in.Close()
				out, err := g.DialContext(context.Background(), "tcp", addr)
				if err != nil {
					return
				}
				defer g.forget(out)
				defer out.Close()
				done := make(chan struct{}, 2)
				pipe := func(dst, src net.Conn) {
					_, _ = io.Copy(dst, src)
					_ = dst.Close()
					_ = src.Close()
					done <- struct{}{}
				}
				go pipe(out, in)
				go pipe(in, out)
				<-done
				<-done
			}()
		}
	}()
	return ln.Addr().String()
}
