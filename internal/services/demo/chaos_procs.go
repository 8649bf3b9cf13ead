package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is one child process of km0 demo --chaos (a `km0 serve NAME` or the
// `km0 kafka` broker), kept running like a service manager with
// Restart=always would: a child that exits by itself is started again after
// crashRestartDelay; one the harness SIGKILLed stays down until start.
type proc struct {
	name  string
	exe   string
	args  []string
	log   string // file that receives the child's stdout and stderr
	ready string // stdout prefix that says the child is up

	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{} // closed when cmd exits
	up       chan struct{} // closed when the ready line was seen
	held     bool          // SIGKILLed on purpose: no restart until start
	stopping bool
	starts   int
	kills    int
	crashes  int // exits the harness did not cause
	lastErr  string
}

// crashRestartDelay is how long a child that exited by itself (e.g. it
// could not reach PostgreSQL while it restarted) stays down.
const crashRestartDelay = time.Second

func newProc(name, exe, logPath, ready string, args ...string) *proc {
	return &proc{name: name, exe: exe, args: args, log: logPath, ready: ready}
}

// start starts the child if it is not running and lifts a hold.
func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.held = false
	return p.launchLocked()
}

func (p *proc) launchLocked() error {
	if p.stopping || p.cmd != nil {
		return nil
	}
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.exe, p.args...)
	cmd.Env = childEnv(os.Environ())
	// The children die with the harness, whatever kills it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stderr = f
	out, err := cmd.StdoutPipe()
	if err != nil {
		f.Close()
		return err
	}
	fmt.Fprintf(f, "==== %s: start #%d: %s %s\n", time.Now().Format(time.RFC3339Nano), p.starts+1, p.exe, strings.Join(p.args, " "))
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	p.starts++
	p.cmd = cmd
	exited, up := make(chan struct{}), make(chan struct{})
	p.exited, p.up = exited, up
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		sc := bufio.NewScanner(out)
		seen := false
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(f, line)
			if !seen && strings.HasPrefix(line, p.ready) {
				seen = true
				close(up)
			}
		}
		_, _ = io.Copy(f, out)
	}()
	go func() {
		<-copied
		err := cmd.Wait()
		fmt.Fprintf(f, "==== %s: exited: %v\n", time.Now().Format(time.RFC3339Nano), err)
		f.Close()
		p.mu.Lock()
		p.cmd = nil
		close(exited)
		restart := !p.held && !p.stopping
		if restart {
			p.crashes++
			p.lastErr = fmt.Sprint(err)
		}
		p.mu.Unlock()
		if restart {
			time.Sleep(crashRestartDelay)
			p.mu.Lock()
			if !p.held {
				_ = p.launchLocked()
			}
			p.mu.Unlock()
		}
	}()
	return nil
}

// childEnv drops the variables that would make a child use other databases,
// topics or groups than the ones the harness checks.
func childEnv(env []string) []string {
	out := make([]string, 0, len(env))
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if k == "KM0_TOPICS" || k == "KM0_GROUPS" || (strings.HasPrefix(k, "KM0_") && strings.HasSuffix(k, "_DATABASE_URL") && k != "KM0_DATABASE_URL") {
			continue
		}
		out = append(out, kv)
	}
	return out
}

// kill SIGKILLs the child (if running) and holds it down until start.
func (p *proc) kill() {
	p.mu.Lock()
	p.held = true
	cmd, exited := p.cmd, p.exited
	if cmd != nil {
		p.kills++
		_ = cmd.Process.Signal(syscall.SIGKILL)
	}
	p.mu.Unlock()
	if cmd != nil {
		<-exited
	}
}

// waitUp waits until the current child printed its ready line. A child that
// exits first is waited for again after its restart.
func (p *proc) waitUp(ctx context.Context) error {
	for {
		p.mu.Lock()
		up, exited, running := p.up, p.exited, p.cmd != nil
		p.mu.Unlock()
		if !running {
			select {
			case <-ctx.Done():
				return fmt.Errorf("%s not up: %w (last exit: %s)", p.name, ctx.Err(), p.lastErr)
			case <-time.After(100 * time.Millisecond):
				continue
			}
		}
		select {
		case <-up:
			return nil
		case <-exited:
		case <-ctx.Done():
			return fmt.Errorf("%s not up: %w", p.name, ctx.Err())
		}
	}
}

// running reports whether the child is running and has printed its ready line.
func (p *proc) running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.up:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM and waits up to grace, then SIGKILLs. It reports
// whether the child stopped by itself within grace.
func (p *proc) stop(grace time.Duration) (bool, error) {
	p.mu.Lock()
	p.stopping = true
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil {
		return true, nil
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		return true, nil
	case <-time.After(grace):
		_ = cmd.Process.Signal(syscall.SIGKILL)
		<-exited
		return false, errors.New(p.name + " did not stop within " + grace.String() + " of SIGTERM: killed")
	}
}

// counts returns starts, SIGKILLs and crashes.
func (p *proc) counts() (starts, kills, crashes int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.starts, p.kills, p.crashes
}
