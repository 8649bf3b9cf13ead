package amqp

import (
	"net"
	"sync"
)

// coalesceMax bounds the bytes a coalescingConn holds unwritten; a Write
// beyond it waits until the flusher has made room.
const coalesceMax = 1 << 20

// coalescingConn is a net.Conn whose Write copies the bytes into a pending
// buffer and returns; one flusher goroutine writes whatever is pending with
// one system call. amqp091-go flushes its buffer after every method (each
// publish, each ack), one write each; when many goroutines publish and ack
// at once, their frames wait behind the write in progress and go together
// in the next, so the sender makes fewer system calls and the broker reads
// fewer segments. Alone, a frame goes at once (the flusher is woken).
//
// A Write that returned has only queued its bytes. A write error closes the
// socket (the reader fails and amqp091-go shuts the connection down, as for
// any write error) and every later Write returns it. Bytes queued when the
// socket fails or is closed are lost, like bytes in the kernel's buffer: a
// frame is never taken as received by the broker before the broker answered
// it (a confirm, a reply), so nothing relies on them.
type coalescingConn struct {
	net.Conn

	mu      sync.Mutex
	room    *sync.Cond // pending shrank or err was set
	pending []byte
	spare   []byte
	err     error
	kick    chan struct{} // cap 1: pending is not empty
	done    chan struct{} // closed by Close
	once    sync.Once
}

func newCoalescingConn(c net.Conn) *coalescingConn {
	cc := &coalescingConn{Conn: c, kick: make(chan struct{}, 1), done: make(chan struct{})}
	cc.room = sync.NewCond(&cc.mu)
	go cc.flush()
	return cc
}

// Write queues p for the flusher.
func (c *coalescingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	for c.err == nil && len(c.pending) > 0 && len(c.pending)+len(p) > coalesceMax {
		c.room.Wait()
	}
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return 0, err
	}
	c.pending = append(c.pending, p...)
	c.mu.Unlock()
	select {
	case c.kick <- struct{}{}:
	default:
	}
	return len(p), nil
}

// flush writes what is pending until Close or a write error.
func (c *coalescingConn) flush() {
	for {
		select {
		case <-c.kick:
		case <-c.done:
			return
		}
		for {
			c.mu.Lock()
			buf := c.pending
			c.pending, c.spare = c.spare[:0], nil
			c.mu.Unlock()
			if len(buf) == 0 {
				c.mu.Lock()
				c.spare = buf
				c.mu.Unlock()
				break
			}
			_, err := c.Conn.Write(buf)
			c.mu.Lock()
			if cap(buf) <= 4*coalesceMax {
				c.spare = buf[:0]
			}
			if err != nil && c.err == nil {
				c.err = err
			}
			c.room.Broadcast()
			c.mu.Unlock()
			if err != nil {
				_ = c.Conn.Close()
				return
			}
		}
	}
}

// Close closes the socket; bytes still pending are dropped.
func (c *coalescingConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.mu.Lock()
		if c.err == nil {
			c.err = net.ErrClosed
		}
		c.room.Broadcast()
		c.mu.Unlock()
		close(c.done)
	})
	return err
}
