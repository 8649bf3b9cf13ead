package demo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/redact"
)

// LocalURL is the local server the demo tries when KM0_DATABASE_URL is unset.
const LocalURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable&connect_timeout=3"

// ErrNoDatabase says no PostgreSQL could be found or started; its message
// says how to get one.
var ErrNoDatabase = errors.New(`no PostgreSQL server: set KM0_DATABASE_URL=postgres://user:pass@host:5432/postgres, ` +
	`or start one at 127.0.0.1:5432 (Debian/Ubuntu: apt-get install postgresql && pg_ctlcluster --skip-systemctl-redirect 15 main start), ` +
	`or install the server binaries (initdb, pg_ctl) so that km0 demo can start a throwaway one`)

// Server is the PostgreSQL server the demo uses.
type Server struct {
	URL    string // an admin URL (database postgres or the one given)
	Source string // "KM0_DATABASE_URL", "local server at 127.0.0.1:5432" or "throwaway cluster in <dir>"
	stop   func()
	// restart stops a throwaway cluster with pg_ctl -m mode and starts it
	// again; nil for a server the demo did not start.
	restart func(ctx context.Context, mode string) error
}

// ErrNotOwned says the server was not started by the demo, so it may not be restarted.
var ErrNotOwned = errors.New("demo: only a throwaway cluster started by the demo can be restarted")

// Restart stops a throwaway cluster with `pg_ctl stop -m mode` (fast: clients
// are disconnected and the server shuts down cleanly; immediate: the server
// stops without a checkpoint and recovers from WAL at the next start) and
// starts it again on the same port, waiting until it accepts connections. A
// server the demo did not start gives ErrNotOwned.
func (s *Server) Restart(ctx context.Context, mode string) error {
	if s.restart == nil {
		return ErrNotOwned
	}
	if mode != "fast" && mode != "immediate" && mode != "smart" {
		return fmt.Errorf("demo: pg_ctl stop mode %q: want fast, immediate or smart", mode)
	}
	return s.restart(ctx, mode)
}

// StartThrowaway starts a throwaway cluster (initdb in a temporary folder,
// then pg_ctl start on a free port of 127.0.0.1) with the binaries found on
// PATH or under /usr/lib/postgresql/*/bin, as the postgres user when running
// as root. Close stops it and removes the folder; Restart restarts it.
func StartThrowaway(ctx context.Context) (*Server, error) { return startThrowaway(ctx) }

// Close stops a throwaway cluster and removes its folder; otherwise it does nothing.
func (s *Server) Close() {
	if s.stop != nil {
		s.stop()
	}
}

// FindServer returns the server of KM0_DATABASE_URL if set (an error if it does
// not answer), else the local server at 127.0.0.1:5432 if it answers, else a
// throwaway cluster started with initdb/pg_ctl found on PATH or under
// /usr/lib/postgresql/*/bin (as the postgres user when running as root, since
// initdb refuses root), else ErrNoDatabase.
func FindServer(ctx context.Context, progress func(string)) (*Server, error) {
	if u := os.Getenv("KM0_DATABASE_URL"); u != "" {
		if err := ping(ctx, u); err != nil {
			return nil, fmt.Errorf("KM0_DATABASE_URL (%s) does not answer: %w", redact.URL(u), err)
		}
		return &Server{URL: u, Source: "KM0_DATABASE_URL"}, nil
	}
	if err := ping(ctx, LocalURL); err == nil {
		return &Server{URL: LocalURL, Source: "local server at 127.0.0.1:5432"}, nil
	}
	progress("no PostgreSQL at 127.0.0.1:5432: starting a throwaway cluster")
	s, err := startThrowaway(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w (throwaway cluster: %v)", ErrNoDatabase, err)
	}
	return s, nil
}

func ping(ctx context.Context, u string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.Ping(ctx)
}

// findBin looks for name on PATH, then in the newest /usr/lib/postgresql/*/bin.
func findBin(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found on PATH or under /usr/lib/postgresql/*/bin", name)
}

func version(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func startThrowaway(ctx context.Context) (*Server, error) {
	initdb, err := findBin("initdb")
	if err != nil {
		return nil, err
	}
	pgctl, err := findBin("pg_ctl")
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "km0-demo-pg-")
	if err != nil {
		return nil, err
	}
	// initdb refuses to run as root: run the server as the postgres user.
	var asUser []string
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			os.RemoveAll(dir)
			return nil, errors.New("running as root and there is no postgres user to run initdb as")
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		runuser, err := exec.LookPath("runuser")
		if err != nil {
			os.RemoveAll(dir)
			return nil, errors.New("running as root and runuser is missing: cannot run initdb as postgres")
		}
		asUser = []string{runuser, "-u", "postgres", "--"}
	}
	run := func(args ...string) error {
		full := append(append([]string{}, asUser...), args...)
		cmd := exec.CommandContext(ctx, full[0], full[1:]...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s: %w: %s", filepath.Base(args[0]), err, lastLines(out.String(), 5))
		}
		return nil
	}
	data := filepath.Join(dir, "data")
	if err := run(initdb, "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off", port, dir)
	if err := run(pgctl, "-D", data, "-o", opts, "-l", filepath.Join(dir, "log"), "-w", "-t", "60", "start"); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	stop := func() {
		_ = run(pgctl, "-D", data, "-m", "fast", "-w", "stop")
		os.RemoveAll(dir)
	}
	restart := func(ctx context.Context, mode string) error {
		cmd := func(args ...string) error {
			full := append(append([]string{}, asUser...), args...)
			c := exec.CommandContext(ctx, full[0], full[1:]...)
			var out bytes.Buffer
			c.Stdout, c.Stderr = &out, &out
			if err := c.Run(); err != nil {
				return fmt.Errorf("%s %s: %w: %s", filepath.Base(args[0]), args[len(args)-1], err, lastLines(out.String(), 5))
			}
			return nil
		}
		if err := cmd(pgctl, "-D", data, "-m", mode, "-w", "-t", "60", "stop"); err != nil {
			return err
		}
		return cmd(pgctl, "-D", data, "-o", opts, "-l", filepath.Join(dir, "log"), "-w", "-t", "120", "start")
	}
	u := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	if err := ping(ctx, u); err != nil {
		stop()
		return nil, err
	}
	return &Server{URL: u, Source: "throwaway cluster in " + dir, stop: stop, restart: restart}, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
