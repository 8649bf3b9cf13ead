// Package pgcluster starts private PostgreSQL servers (initdb in a temporary
// directory, a free port, a socket directory of their own) for tests and
// benchmarks that need settings the machine's shared server must not get.
package pgcluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/url"
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

// BinDirDefault holds the PostgreSQL server binaries a private cluster runs.
const BinDirDefault = "/usr/lib/postgresql/15/bin"

// Options configure Start. The zero value starts a cluster with
// wal_level=logical.
type Options struct {
	// BinDir holds initdb and postgres. Default $KM0_PG_BIN_DIR, else
	// BinDirDefault.
	BinDir string
	// Settings are extra postgresql.conf settings (name → value), applied on
	// top of: wal_level=logical, fsync=on, max_replication_slots and
	// max_wal_senders 20, listen_addresses=127.0.0.1.
	Settings map[string]string
	// TLS, when set, turns ssl on with these files (copied into the
	// cluster's directory, the key readable by the server alone) and makes
	// every TCP connection use TLS: pg_hba.conf gets hostssl lines only
	// (trust, cert for CertUsers, scram-sha-256 for PasswordUsers), plain
	// TCP is refused. Default nil: TCP without TLS, trust.
	TLS *TLS
}

// TLS are the server files of a cluster with ssl=on.
type TLS struct {
	// CertFile and KeyFile are the server's certificate and key (PEM). The
	// certificate must name 127.0.0.1 for sslmode=verify-full.
	CertFile, KeyFile string
	// CAFile verifies client certificates (ssl_ca_file), and is the
	// sslrootcert of Cluster.URL.
	CAFile string
	// CertUsers authenticate with a client certificate whose common name
	// is their name (pg_hba method cert), over TCP; no password or trust.
	// The roles are not created.
	CertUsers []string
	// PasswordUsers authenticate with their password (pg_hba method
	// scram-sha-256) over TCP, never trusted: a wrong or missing password
	// is refused. The roles (and their passwords) are not created.
	PasswordUsers []string
}

// Cluster is a private PostgreSQL server of its own data directory, port and
// socket directory, for tests that need settings the machine's shared server
// must not get (wal_level=logical) or that restart the server.
type Cluster struct {
	// URL connects as the superuser postgres over TCP (trust); with
	// Options.TLS over TLS, sslmode=verify-full and sslrootcert the CA.
	URL   string
	Port  int
	dir   string // holds data/ and sock/
	bin   string
	cmd   *exec.Cmd
	runAs *user.User // the postgres user when this process is root
	done  chan error
	args  []string // postgres's command line, for Restart
}

// Start runs initdb in a new temporary directory and starts a server
// on a free port, waiting until it accepts connections. When the process runs
// as root (initdb and postgres refuse root), both run as the system user
// postgres. Stop the cluster with Stop, which removes its directory. The
// error names what failed, with the server's log when it did not start.
func Start(opts Options) (*Cluster, error) {
	c := &Cluster{bin: cmp.Or(opts.BinDir, os.Getenv("KM0_PG_BIN_DIR"), BinDirDefault), done: make(chan error, 1)}
	if _, err := os.Stat(filepath.Join(c.bin, "initdb")); err != nil {
		return nil, fmt.Errorf("pgcluster: PostgreSQL server binaries are required to start a private cluster: %w", err)
	}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("pgcluster: running as root, and initdb refuses root: no user postgres to run it as: %w", err)
		}
		c.runAs = u
	}
	dir, err := os.MkdirTemp("", "km0-pgcluster-")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: %w", err)
	}
	c.dir = dir
	ok := false
	defer func() {
		if !ok {
			c.Stop()
		}
	}()
	for _, d := range []string{dir, filepath.Join(dir, "sock")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("pgcluster: %w", err)
		}
		if err := c.chown(d); err != nil {
			return nil, err
		}
	}
	data := filepath.Join(dir, "data")
	if out, err := c.command("initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
		"--locale=C", "--no-sync").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("pgcluster: initdb: %w: %s", err, strings.TrimSpace(string(out)))
	}
	if c.Port, err = localserver.FreePort(); err != nil {
		return nil, err
	}
	var tlsSettings map[string]string
	if opts.TLS != nil {
		if tlsSettings, err = c.setupTLS(data, *opts.TLS); err != nil {
			return nil, err
		}
	}
	settings := map[string]string{
		"wal_level": "logical", "fsync": "on", "max_replication_slots": "20", "max_wal_senders": "20",
		"listen_addresses": "127.0.0.1", "port": strconv.Itoa(c.Port), "unix_socket_directories": filepath.Join(dir, "sock"),
		"shared_buffers": "64MB", "max_connections": "100", "logging_collector": "off",
	}
	for k, v := range tlsSettings {
		settings[k] = v
	}
	for k, v := range opts.Settings {
		settings[k] = v
	}
	c.args = []string{"-D", data}
	for k, v := range settings {
		c.args = append(c.args, "-c", k+"="+v)
	}
	c.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.Port)
	if opts.TLS != nil {
		c.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=verify-full&sslrootcert=%s",
			c.Port, url.QueryEscape(opts.TLS.CAFile))
	}
	if err := c.run(); err != nil {
		return nil, err
	}
	ok = true
	return c, nil
}

// Crash stops the server the way pg_ctl stop -m immediate does (SIGQUIT:
// every process exits at once, no checkpoint; the next start recovers from
// the WAL) and waits for it to exit. Restart starts it again.
func (c *Cluster) Crash() {
	if c.cmd == nil || c.cmd.Process == nil {
		return
	}
	localserver.Stop(c.cmd.Process, syscall.SIGQUIT, c.done, 20*time.Second)
	c.cmd = nil
}

// Restart starts the server again, on the same data directory and port,
// after Crash, waiting until it accepts connections (crash recovery done).
func (c *Cluster) Restart() error {
	if c.cmd != nil {
		return errors.New("pgcluster: Restart of a running server")
	}
	return c.run()
}

// run starts postgres and waits until it accepts connections.
func (c *Cluster) run() error {
	logPath := filepath.Join(c.dir, "server.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	defer logFile.Close()
	if err := c.chown(logPath); err != nil {
		return err
	}
	c.cmd = c.command("postgres", c.args...)
	c.cmd.Stdout, c.cmd.Stderr = logFile, logFile
	if err := c.cmd.Start(); err != nil {
		return fmt.Errorf("pgcluster: start postgres: %w", err)
	}
	cmd := c.cmd
	go func() { c.done <- cmd.Wait() }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, c.URL)
		cancel()
		if err == nil {
			_ = conn.Close(context.Background())
			break
		}
		select {
		case werr := <-c.done:
			log, _ := os.ReadFile(logPath)
			c.cmd = nil
			return fmt.Errorf("pgcluster: postgres exited (%v): %s", werr, tail(string(log)))
		default:
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(logPath)
			return fmt.Errorf("pgcluster: postgres did not accept connections within 60s: %v: %s", err, tail(string(log)))
		}
		time.Sleep(50 * time.Millisecond) // polling the server's start with a deadline
	}
	return nil
}

// Stop stops the server (fast shutdown, then a kill after 20 s) and removes
// the cluster's directory. It is safe to call more than once.
func (c *Cluster) Stop() {
	if c.cmd != nil && c.cmd.Process != nil {
		localserver.Stop(c.cmd.Process, syscall.SIGINT, c.done, 20*time.Second) // fast shutdown
		c.cmd = nil
	}
	if c.dir != "" {
		_ = os.RemoveAll(c.dir)
		c.dir = ""
	}
}

func (c *Cluster) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(c.bin, name), args...)
	if c.runAs != nil {
		uid, _ := strconv.Atoi(c.runAs.Uid)
		gid, _ := strconv.Atoi(c.runAs.Gid)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
		cmd.Dir = c.dir
		cmd.Env = append(os.Environ(), "HOME="+c.dir, "USER=postgres", "LOGNAME=postgres")
	}
	// Its own process group: a signal to the test's group (Ctrl-C) does not
	// reach the server before Stop shuts it down. If this process dies
	// without Stop (a test binary killed at its timeout), the server gets
	// SIGINT, a fast shutdown, instead of running on.
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	cmd.SysProcAttr.Pdeathsig = syscall.SIGINT
	return cmd
}

func (c *Cluster) chown(path string) error {
	if c.runAs == nil {
		return nil
	}
	uid, _ := strconv.Atoi(c.runAs.Uid)
	gid, _ := strconv.Atoi(c.runAs.Gid)
	if err := os.Chown(path, uid, gid); err != nil {
		return fmt.Errorf("pgcluster: chown %s to postgres: %w", path, err)
	}
	return nil
}

func tail(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > 2000 {
		s = "…" + s[len(s)-2000:]
	}
	return s
}

// CPU is the processor time the server has used so far: the postmaster's
// own, that of its exited children (which it has waited for) and that of the
// live ones (backends, walsenders, background workers), read from /proc. It
// is 0 where there is no procfs. Benchmarks read it before and after a run.
func (c *Cluster) CPU() time.Duration {
	if c.cmd == nil || c.cmd.Process == nil {
		return 0
	}
	return ServerCPU(c.cmd.Process.Pid)
}

// ProcessCPU is the processor time of each live server process (the
// postmaster's children) by pid, from /proc; nil where there is none.
func (c *Cluster) ProcessCPU() map[int]time.Duration {
	if c.cmd == nil || c.cmd.Process == nil {
		return nil
	}
	return ServerProcessCPU(c.cmd.Process.Pid)
}

// Postmaster is the postmaster of a server process of this machine (the
// parent of backend, a pg_backend_pid()), or 0 when /proc does not show it
// (the server runs elsewhere).
func Postmaster(backend int) int {
	return procParent(backend)
}

// ServerCPU is the processor time of the server of postmaster pm: its own,
// that of its exited children and that of its live ones, from /proc; 0 when
// /proc does not show it.
func ServerCPU(pm int) time.Duration {
	total := procTicks(pm, true)
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == pm {
			continue
		}
		if procParent(pid) == pm {
			total += procTicks(pid, false)
		}
	}
	return time.Duration(total) * time.Second / clockTicks
}

// ServerProcessCPU is the processor time of each live child of postmaster
// pm by pid, from /proc.
func ServerProcessCPU(pm int) map[int]time.Duration {
	out := map[int]time.Duration{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil && procParent(pid) == pm {
			out[pid] = time.Duration(procTicks(pid, false)) * time.Second / clockTicks
		}
	}
	return out
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat's times on Linux.
const clockTicks = 100

// procStat returns the fields of /proc/pid/stat after the command name
// (field 3, the state, is index 0), or nil.
func procStat(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

func procParent(pid int) int {
	f := procStat(pid)
	if len(f) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// procTicks is utime+stime of pid, plus cutime+cstime when children is set.
func procTicks(pid int, children bool) int64 {
	f := procStat(pid)
	if len(f) < 15 {
		return 0
	}
	var t int64
	idx := []int{11, 12} // utime, stime (fields 14 and 15)
	if children {
		idx = append(idx, 13, 14) // cutime, cstime
	}
	for _, i := range idx {
		v, _ := strconv.ParseInt(f[i], 10, 64)
		t += v
	}
	return t
}

// setupTLS copies the files of t into the data directory, owned by the
// server's user (the key 0600, as PostgreSQL demands), writes a pg_hba.conf
// that takes TCP connections over TLS only, and returns the ssl settings.
func (c *Cluster) setupTLS(data string, t TLS) (map[string]string, error) {
	files := map[string]string{"server.crt": t.CertFile, "server.key": t.KeyFile, "root.crt": t.CAFile}
	for name, src := range files {
		b, err := os.ReadFile(src)
		if err != nil {
			return nil, fmt.Errorf("pgcluster: TLS: %w", err)
		}
		dst := filepath.Join(data, name)
		if err := os.WriteFile(dst, b, 0o600); err != nil {
			return nil, fmt.Errorf("pgcluster: TLS: %w", err)
		}
		if err := c.chown(dst); err != nil {
			return nil, err
		}
	}
	var hba strings.Builder
	hba.WriteString("# written by pgcluster: TCP over TLS only\nlocal all all trust\nlocal replication all trust\n")
	for _, u := range t.CertUsers {
		fmt.Fprintf(&hba, "hostssl all %[1]s 127.0.0.1/32 cert\nhostssl replication %[1]s 127.0.0.1/32 cert\n", u)
	}
	for _, u := range t.PasswordUsers {
		fmt.Fprintf(&hba, "hostssl all %[1]s 127.0.0.1/32 scram-sha-256\nhostssl replication %[1]s 127.0.0.1/32 scram-sha-256\n", u)
	}
	hba.WriteString("hostssl all all 127.0.0.1/32 trust\nhostssl replication all 127.0.0.1/32 trust\n" +
		"hostnossl all all 0.0.0.0/0 reject\nhostnossl replication all 0.0.0.0/0 reject\n")
	if err := os.WriteFile(filepath.Join(data, "pg_hba.conf"), []byte(hba.String()), 0o600); err != nil {
		return nil, fmt.Errorf("pgcluster: TLS: %w", err)
	}
	if err := c.chown(filepath.Join(data, "pg_hba.conf")); err != nil {
		return nil, err
	}
	return map[string]string{"ssl": "on", "ssl_cert_file": "server.crt", "ssl_key_file": "server.key", "ssl_ca_file": "root.crt"}, nil
}
