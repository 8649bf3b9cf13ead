// Package pgbouncer starts Debian's PgBouncer in front of a PostgreSQL server
// for tests: a configuration of its own in a temporary directory, a free
// port, trust authentication for the user postgres, and the pool mode the
// test asks for (transaction or session pooling).
package pgbouncer

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/localserver"
)

// BinDefault is Debian's pgbouncer binary (apt-get install pgbouncer).
const BinDefault = "/usr/sbin/pgbouncer"

// Pool modes of Options.Mode.
const (
	Transaction = "transaction"
	Session     = "session"
)

// Options configure Start.
type Options struct {
	// Upstream is the server's host:port, e.g. a pgcluster.Cluster's
	// "127.0.0.1:<Port>". Required.
	Upstream string
	// Mode is the pool_mode: Transaction or Session. Required.
	Mode string
	// PoolSize is default_pool_size, the server connections per database
	// and user. Default 10.
	PoolSize int
	// Bin is the pgbouncer binary. Default $KM0_PGBOUNCER, else BinDefault.
	Bin string
}

// Bouncer is a running pgbouncer. Stop it with Stop.
type Bouncer struct {
	// Port is the port it listens on, on 127.0.0.1.
	Port int
	dir  string
	cmd  *exec.Cmd
	done chan error
}

// URL is the connection URL of database db through the bouncer, as the
// superuser postgres, with extra appended as query parameters (for example
// "default_query_exec_mode=cache_describe").
func (b *Bouncer) URL(db string, extra ...string) string {
	u := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", b.Port, db)
	for _, e := range extra {
		u += "&" + e
	}
	return u
}

// Start writes the configuration and starts pgbouncer, waiting until it
// accepts a connection and runs a query on the upstream server. When this
// process runs as root (pgbouncer refuses root) it runs as the system user
// postgres. The error names what failed, with pgbouncer's log.
func Start(opts Options) (*Bouncer, error) {
	bin := cmp.Or(opts.Bin, os.Getenv("KM0_PGBOUNCER"), BinDefault)
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("pgbouncer: the pgbouncer binary is required (apt-get install pgbouncer): %w", err)
	}
	if opts.Mode != Transaction && opts.Mode != Session {
		return nil, fmt.Errorf("pgbouncer: Mode %q is neither %q nor %q", opts.Mode, Transaction, Session)
	}
	host, port, err := net.SplitHostPort(opts.Upstream)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: Upstream %q is not host:port: %w", opts.Upstream, err)
	}
	var runAs *user.User
	if os.Geteuid() == 0 {
		if runAs, err = user.Lookup("postgres"); err != nil {
			return nil, fmt.Errorf("pgbouncer: running as root, which pgbouncer refuses, and no user postgres to run it as: %w", err)
		}
	}
	dir, err := os.MkdirTemp("", "km0-pgbouncer-")
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: %w", err)
	}
	b := &Bouncer{dir: dir, done: make(chan error, 1)}
	ok := false
	defer func() {
		if !ok {
			b.Stop()
		}
	}()
	if b.Port, err = localserver.FreePort(); err != nil {
		return nil, err
	}
	logPath := filepath.Join(dir, "pgbouncer.log")
	ini := strings.Join([]string{
		"[databases]",
		fmt.Sprintf("* = host=%s port=%s", host, port),
		"[pgbouncer]",
		"listen_addr = 127.0.0.1",
		"listen_port = " + strconv.Itoa(b.Port),
		"unix_socket_dir =",
		"auth_type = trust",
		"auth_file = " + filepath.Join(dir, "users.txt"),
		"pool_mode = " + opts.Mode,
		"default_pool_size = " + strconv.Itoa(cmp.Or(opts.PoolSize, 10)),
		"max_client_conn = 500",
		"logfile = " + logPath,
		"admin_users = postgres",
		"",
	}, "\n")
	files := map[string]string{"pgbouncer.ini": ini, "users.txt": `"postgres" ""` + "\n"}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o600); err != nil {
			return nil, fmt.Errorf("pgbouncer: %w", err)
		}
	}
	if runAs != nil {
		uid, _ := strconv.Atoi(runAs.Uid)
		gid, _ := strconv.Atoi(runAs.Gid)
		for _, p := range []string{dir, filepath.Join(dir, "pgbouncer.ini"), filepath.Join(dir, "users.txt")} {
			if err := os.Chown(p, uid, gid); err != nil {
				return nil, fmt.Errorf("pgbouncer: chown %s to postgres: %w", p, err)
			}
		}
	}
	b.cmd = exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	b.cmd.Dir = dir
	// Its own process group, and SIGINT (a safe shutdown) if this process
	// dies without Stop.
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGINT}
	if runAs != nil {
		uid, _ := strconv.Atoi(runAs.Uid)
		gid, _ := strconv.Atoi(runAs.Gid)
		b.cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	if err := b.cmd.Start(); err != nil {
		return nil, fmt.Errorf("pgbouncer: start: %w", err)
	}
	go func() { b.done <- b.cmd.Wait() }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := ping(ctx, b.URL("postgres"))
		cancel()
		if err == nil {
			break
		}
		select {
		case werr := <-b.done:
			b.done <- werr
			log, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("pgbouncer: exited (%v): %s", werr, strings.TrimSpace(string(log)))
		default:
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("pgbouncer: no query through it within 30s: %v: %s", err, strings.TrimSpace(string(log)))
		}
		time.Sleep(50 * time.Millisecond) // polling the start with a deadline
	}
	ok = true
	return b, nil
}

func ping(ctx context.Context, u string) error {
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, "SELECT 1", pgx.QueryExecModeSimpleProtocol)
	return err
}

// Version is the output of `pgbouncer --version`'s first line, e.g.
// "PgBouncer 1.18.0", or the error that running it gave.
func Version(bin string) (string, error) {
	out, err := exec.Command(cmp.Or(bin, os.Getenv("KM0_PGBOUNCER"), BinDefault), "--version").Output()
	if err != nil {
		return "", fmt.Errorf("pgbouncer: --version: %w", err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(first), nil
}

// Stop stops pgbouncer (SIGINT, then a kill after 10 s) and removes its
// directory. It is safe to call more than once.
func (b *Bouncer) Stop() {
	if b.cmd != nil && b.cmd.Process != nil {
		localserver.Stop(b.cmd.Process, syscall.SIGINT, b.done, 10*time.Second)
		b.cmd = nil
	}
	if b.dir != "" {
		_ = os.RemoveAll(b.dir)
		b.dir = ""
	}
}
