package amqp

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// countingConn counts the writes that reach the socket.
type countingConn struct {
	net.Conn
	writes atomic.Int64
	gate   chan struct{} // if set, each write waits for a token
}

func (c *countingConn) Write(p []byte) (int, error) {
	if c.gate != nil {
		<-c.gate
	}
	c.writes.Add(1)
	return c.Conn.Write(p)
}

func loopback(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() { c, _ := ln.Accept(); accepted <- c }()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	t.Cleanup(func() { _ = client.Close(); _ = server.Close() })
	return client, server
}

// Concurrent writes arrive whole, each writer's in its order, and those
// queued behind a write in progress go out together.
func TestCoalescingConnKeepsEveryWriteWholeAndInOrder(t *testing.T) {
	client, server := loopback(t)
	gate := make(chan struct{})
	cc := &countingConn{Conn: client, gate: gate}
	c := newCoalescingConn(cc)
	const writers, each = 8, 200
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				if _, err := fmt.Fprintf(c, "w%d-%d\n", w, i); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	// The socket accepts one write at a time while the writers run.
	go func() {
		for range writers * each {
			select {
			case gate <- struct{}{}:
			case <-time.After(5 * time.Second):
				return
			}
		}
	}()
	next := make([]int, writers)
	sc := bufio.NewScanner(server)
	for n := 0; n < writers*each; n++ {
		if !sc.Scan() {
			t.Fatalf("after %d lines: %v", n, sc.Err())
		}
		var w, i int
		if _, err := fmt.Sscanf(sc.Text(), "w%d-%d", &w, &i); err != nil || w >= writers || i != next[w] {
			t.Fatalf("line %d %q: want w%d-%d", n, sc.Text(), w, next[w])
		}
		next[w]++
	}
	wg.Wait()
	if got := cc.writes.Load(); got >= writers*each {
		t.Fatalf("%d socket writes for %d Writes: nothing coalesced", got, writers*each)
	} else {
		t.Logf("%d socket writes for %d Writes", got, writers*each)
	}
}

// A failed socket write closes the socket and fails the later Writes.
func TestCoalescingConnFailsLaterWritesAfterAWriteError(t *testing.T) {
	client, server := loopback(t)
	c := newCoalescingConn(client)
	_ = client.(*net.TCPConn).SetWriteDeadline(time.Now().Add(-time.Second)) // every socket write fails
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatalf("the first Write only queues: %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := c.Write([]byte("y")); err != nil {
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() {
				t.Fatalf("want the socket's timeout, got %v", err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Writes still succeed after the socket write failed")
		}
		time.Sleep(time.Millisecond)
	}
	// The socket was closed: the peer reads EOF.
	_ = server.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadAll(server); err != nil {
		t.Fatalf("peer: %v", err)
	}
	_ = c.Close()
	if _, err := c.Write([]byte("z")); err == nil {
		t.Fatal("Write after Close succeeded")
	}
}
