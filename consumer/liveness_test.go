package consumer_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// The liveness proof runs the broker and the group members as separate OS
// processes: this test binary, re-executed with roleEnv set (see TestMain).
// With KM0_LIVENESS_DEBUG=DIR the children log at debug level (kgo, kfake)
// and a failed run leaves each child's log in DIR. KM0_LIVENESS_SESSION
// overrides the members' session timeout (0s: consumer's default).
const (
	roleEnv   = "KM0_LIVENESS_ROLE" // "broker" or "consumer"
	lvTopic   = "viu.esdeveniments"
	lvGroup   = "viu"
	lvName    = "viu.efecte"
	lvSession = 2 * time.Second // the members' session timeout (the default is 10 s)
	lvRecords = 3000
)

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case "":
		os.Exit(m.Run())
	case "broker":
		os.Exit(child(brokerChild))
	case "consumer":
		os.Exit(child(consumerChild))
	default:
		fmt.Fprintf(os.Stderr, "%s: unknown role %q\n", roleEnv, os.Getenv(roleEnv))
		os.Exit(2)
	}
}

// child runs fn until its stdin closes: the parent closed it, or died.
func child(fn func(context.Context) error) int {
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); cancel() }()
	if err := fn(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	return 0
}

// brokerChild is `km0 kafka --data-dir` with a low group.min.session.timeout.ms.
func brokerChild(ctx context.Context) error {
	var extra []kfake.Opt
	if os.Getenv("KM0_LIVENESS_DEBUG") != "" {
		extra = append(extra, kfake.WithLogger(kfake.BasicLogger(os.Stderr, kfake.LogLevelDebug)))
	}
	b, err := kafkaembed.Start(kafkaembed.Config{Addr: os.Getenv("KM0_LIVENESS_ADDR"), DataDir: os.Getenv("KM0_LIVENESS_DATA"),
		Topics: []string{lvTopic}, GroupMinSessionTimeout: 100 * time.Millisecond, Extra: extra})
	if err != nil {
		return err
	}
	defer b.Close()
	fmt.Println("ready")
	<-ctx.Done()
	return nil
}

// consumerChild is one member of lvGroup: km0's consumer with its inbox,
// applying each event once into efectes.
func consumerChild(ctx context.Context) error {
	pool, err := pgxpool.New(ctx, os.Getenv("KM0_LIVENESS_DB"))
	if err != nil {
		return err
	}
	defer pool.Close()
	session := lvSession
	if d, err := time.ParseDuration(os.Getenv("KM0_LIVENESS_SESSION")); err == nil {
		session = d // 0: the default
	}
	kopts := []kgo.Opt{kgo.ClientID(os.Getenv("KM0_LIVENESS_ID"))}
	if os.Getenv("KM0_LIVENESS_DEBUG") != "" {
		kopts = append(kopts, kgo.WithLogger(kgo.BasicLogger(os.Stderr, kgo.LogLevelDebug, nil)))
	}
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: []string{os.Getenv("KM0_LIVENESS_ADDR")}, Group: lvGroup,
		Topics: []string{lvTopic}, SessionTimeout: session, KgoOpts: kopts})
	if err != nil {
		return err
	}
	c, err := consumer.New(consumer.Config{
		Source: src,
		Name:   lvName, Pool: pool, Names: migrate.Names{Schema: os.Getenv("KM0_LIVENESS_SCHEMA")},
		Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO efectes (id) VALUES ($1)`, m.Envelope.ID)
			return err
		},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// TestGroupRecoversFromSIGKILLedMembers: three members consume a stream; one
// is SIGKILLed mid-stream and crash-loops (each restart is SIGKILLed again
// while it waits in JoinGroup for its dead predecessor's session to expire)
// before it comes back for good. Every partition's committed offset must reach
// the log end within a bound of a few session timeouts, and every effect be
// applied exactly once. The second run also SIGKILLs and restarts the broker
// while the member is dead.
func TestGroupRecoversFromSIGKILLedMembers(t *testing.T) {
	t.Parallel()
	t.Run("member", func(t *testing.T) { livenessRun(t, false) })
	t.Run("member and broker", func(t *testing.T) { livenessRun(t, true) })
}

func livenessRun(t *testing.T, killBroker bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s := pgtest.NewSchema(t)
	if _, err := migrate.Up(ctx, s.Pool, s.Names(), migrate.Inbox); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `CREATE TABLE efectes (id TEXT NOT NULL)`); err != nil { // no key: a double effect shows
		t.Fatal(err)
	}
	addr := freeAddr(t)
	brokerEnv := []string{roleEnv + "=broker", "KM0_LIVENESS_ADDR=" + addr, "KM0_LIVENESS_DATA=" + t.TempDir()}
	broker := startProc(t, "broker", brokerEnv)
	broker.waitReady(t)

	cl, err := kafka.NewClient([]string{addr})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)

	restarts := map[string]int{}
	startMember := func(m string) (*proc, string) {
		restarts[m]++
		id := fmt.Sprintf("membre-%s-%d", m, restarts[m])
		return startProc(t, id, []string{roleEnv + "=consumer", "KM0_LIVENESS_ADDR=" + addr, "KM0_LIVENESS_DB=" + s.URL,
			"KM0_LIVENESS_SCHEMA=" + s.Name, "KM0_LIVENESS_ID=" + id}), id
	}
	startMember("A")
	b1, _ := startMember("B")
	startMember("C")
	waitGroup(ctx, t, cl, "three members, Stable", func(g kmsg.DescribeGroupsResponseGroup) bool {
		return g.State == "Stable" && len(g.Members) == 3
	})

	produce(ctx, t, cl, lvRecords/2)
	testkit.Eventually(t, 60*time.Second, "the stream to be under way", func() bool { return count(ctx, t, s, `SELECT count(*) FROM efectes`) >= lvRecords/8 })
	b1.kill()
	if killBroker {
		broker.kill()
		broker = startProc(t, "broker", brokerEnv)
		broker.waitReady(t)
	}
	// The crash loop. Each restart joins, and its JoinGroup waits for the
	// dead member's session to expire; it dies there.
	parked := 0
	for range 4 {
		p, id := startMember("B")
		g := waitGroup(ctx, t, cl, id+" in the group", func(g kmsg.DescribeGroupsResponseGroup) bool {
			for _, m := range g.Members {
				if m.ClientID == id {
					return true
				}
			}
			return false
		})
		if g.State == "PreparingRebalance" {
			parked++
		}
		p.kill()
	}
	_, last := startMember("B")
	restarted := time.Now()
	produce(ctx, t, cl, lvRecords-lvRecords/2)

	// Bound: the dead members' sessions, two rebalances, and margin for a
	// loaded machine; without expiry a dead member holds its partitions for
	// the 60 s rebalance timeout or for good.
	bound := 5*lvSession + 10*time.Second
	testkit.Eventuallyf(t, bound, "the committed offsets at the log end after the last restart", func() (bool, string) {
		if lag := groupLag(ctx, adm); lag != "" {
			return false, lag
		}
		return true, ""
	})
	t.Logf("caught up %v after %s started; %d of 4 crash-loop restarts died parked in JoinGroup",
		time.Since(restarted).Round(100*time.Millisecond), last, parked)
	if parked == 0 {
		t.Fatalf("no restart died parked in JoinGroup: the crash loop did not exercise a dead joining member")
	}
	if ends, err := adm.ListEndOffsets(ctx, lvTopic); err == nil {
		var total int64
		ends.Each(func(o kadm.ListedOffset) { total += o.Offset })
		if total != lvRecords {
			// The broker keeps the producer's sequences across its
			// SIGKILL (rebuilt from the log), so a copy here would come
			// from the client giving up on a sequence (a producer id
			// reset) around the restart. Copies carry the same
			// id_esdeveniment, and the inbox absorbs them (checked
			// below).
			t.Logf("the topic holds %d records for %d produced", total, lvRecords)
		}
	}
	if n, d := count(ctx, t, s, `SELECT count(*) FROM efectes`), count(ctx, t, s, `SELECT count(DISTINCT id) FROM efectes`); n != lvRecords || d != lvRecords {
		t.Fatalf("effects: %d rows, %d distinct, want %d each", n, d, lvRecords)
	}
	if k := count(ctx, t, s, `SELECT count(*) FROM missatges_processats`); k != lvRecords {
		t.Fatalf("inbox: %d keys, want %d", k, lvRecords)
	}
}

// groupLag describes the partitions of lvTopic whose committed offset is not
// at the log end ("" if none).
func groupLag(ctx context.Context, adm *kadm.Client) string {
	ends, err := adm.ListEndOffsets(ctx, lvTopic)
	if err != nil {
		return err.Error()
	}
	offs, err := adm.FetchOffsets(ctx, lvGroup)
	if err != nil {
		return err.Error()
	}
	var lag []string
	total := int64(0)
	for p := range int32(kafka.PartitionsDefault) {
		end, _ := ends.Lookup(lvTopic, p)
		total += end.Offset
		c, ok := offs.Lookup(lvTopic, p)
		if !ok || c.At != end.Offset {
			lag = append(lag, fmt.Sprintf("p%d %d/%d", p, c.At, end.Offset))
		}
	}
	if total < lvRecords {
		lag = append(lag, fmt.Sprintf("log end %d of %d", total, lvRecords))
	}
	return strings.Join(lag, ", ")
}

func produce(ctx context.Context, t *testing.T, cl *kgo.Client, n int) {
	t.Helper()
	recs := make([]*kgo.Record, n)
	for i := range recs {
		id := uuid.NewString()
		v := fmt.Sprintf(`{"id_esdeveniment":%q,"tipus":"viu.fet","versio":1,"data_ms":1789000000000,"origen":"proves","dades":{"n":%d}}`, id, i)
		recs[i] = &kgo.Record{Topic: lvTopic, Key: []byte(fmt.Sprintf("clau-%d", i%97)), Value: []byte(v),
			Headers: []kgo.RecordHeader{{Key: "tipus", Value: []byte("viu.fet")}, {Key: "id_esdeveniment", Value: []byte(id)}}}
	}
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

func count(ctx context.Context, t *testing.T, s *pgtest.Schema, q string) int {
	t.Helper()
	var n int
	if err := s.Pool.QueryRow(ctx, q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitGroup polls DescribeGroups until ok holds for lvGroup (60 s at most).
func waitGroup(ctx context.Context, t *testing.T, cl *kgo.Client, what string, ok func(kmsg.DescribeGroupsResponseGroup) bool) kmsg.DescribeGroupsResponseGroup {
	t.Helper()
	var g kmsg.DescribeGroupsResponseGroup
	testkit.Eventually(t, 60*time.Second, what, func() bool {
		req := kmsg.NewPtrDescribeGroupsRequest()
		req.Groups = []string{lvGroup}
		resp, err := req.RequestWith(ctx, cl)
		if err != nil || len(resp.Groups) != 1 || resp.Groups[0].ErrorCode != 0 {
			return false
		}
		g = resp.Groups[0]
		return ok(g)
	})

	return g
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// proc is a child process of the test binary.
type proc struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *lockedBuffer // stderr, shown if the test fails
	ready chan struct{} // closed when the child prints "ready"
	done  chan struct{} // closed when it has exited
}

func startProc(t *testing.T, name string, env []string) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	p := &proc{name: name, cmd: cmd, out: &lockedBuffer{}, ready: make(chan struct{}), done: make(chan struct{})}
	cmd.Stderr = p.out
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "ready" {
				close(p.ready)
			}
		}
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if d := os.Getenv("KM0_LIVENESS_DEBUG"); d != "" && t.Failed() {
			_ = os.WriteFile(fmt.Sprintf("%s/%s-%d.log", d, name, p.cmd.Process.Pid), []byte(p.out.String()), 0o644)
		}
		if out := p.out.tail(4000); t.Failed() && out != "" && os.Getenv("KM0_LIVENESS_DEBUG") == "" {
			t.Logf("%s stderr:\n%s", name, out)
		}
	})
	return p
}

func (p *proc) waitReady(t *testing.T) {
	t.Helper()
	select {
	case <-p.ready:
	case <-p.done:
		t.Fatalf("%s exited before it was ready: %s", p.name, p.out.tail(2000))
	case <-time.After(60 * time.Second):
		t.Fatalf("%s not ready within 60 s", p.name)
	}
}

// kill SIGKILLs the process and waits for it to be gone.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(b)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *lockedBuffer) tail(n int) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.b.String()
	return s[max(0, len(s)-n):]
}
