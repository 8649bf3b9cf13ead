package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport/kafka"
)

// secured is a kfake broker with SASL SCRAM-SHA-512 over TLS (a test CA)
// and the flags and environment a km0 command needs for it.
type secured struct {
	b     *kafkatest.Secure
	flags []string // --brokers and the security flags, without the password
	env   []string // KM0_KAFKA_SASL_PASSWORD
	adm   *kadm.Client
}

func newSecured(t *testing.T, topics ...string) *secured {
	t.Helper()
	b := kafkatest.NewSecure(t, kafkatest.SecureConfig{Mechanism: kafka.SASLScramSHA512, TLS: true, Topics: topics})
	return &secured{b: b, adm: kadm.NewClient(kafkatest.Client(t, b.Broker, b.Opts(t)...)),
		flags: []string{"--brokers", strings.Join(b.Addrs(), ","), "--kafka-tls-ca-file", b.PKI.CAFile,
			"--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-username", b.Security.SASLUsername},
		env: []string{"KM0_KAFKA_SASL_PASSWORD=" + b.Security.SASLPassword}}
}

// noPassword fails if what a process printed shows the broker's password.
func (s *secured) noPassword(t *testing.T, what, out string) {
	t.Helper()
	if strings.Contains(out, s.b.Security.SASLPassword) {
		t.Fatalf("%s printed the SASL password:\n%s", what, out)
	}
}

// runKm0 runs `km0 args...` as a process to its end with env added and
// returns its stdout, stderr and exit error.
func runKm0(t *testing.T, env []string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second) // bounds a hang only
	defer cancel()
	cmd := exec.CommandContext(ctx, km0Bin(t), args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KM0_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(append(cmd.Env, runMainEnv+"=1", replicationFactorEnv+"=1"), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("km0 %s did not end within a minute:\n%s", strings.Join(args, " "), errOut.String())
	}
	return out.String(), errOut.String(), err
}

// `km0 relay`, `km0 lag`, `km0 dlq ls`, `km0 serve inventari` and `km0
// console` run as processes against Kafka with SASL_SSL (SCRAM-SHA-512, a
// test CA), the password only in the environment or a file: the relay's
// 20 rows reach the topic, lag reports the group's 20, the service's
// consumer group and the console's DLQ indexer join with one member each,
// and no output shows the password.
func TestCommandsRunOverSASLSSL(t *testing.T) {
	t.Parallel()
	const topic = "comandes.esdeveniments"
	sec := newSecured(t, system.DomainTopics()...)
	s := pgtest.NewMigratedSchema(t)

	// km0 relay: 20 rows of the outbox on the topic.
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: s.Names()})
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		if err := ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: []string{"P-1", "P-2"}[i%2],
			Type: "comanda.creada", Payload: map[string]int{"i": i}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	relayProc := startKm0(t, append([]string{"KM0_DATABASE_URL=" + pgtest.URL()}, sec.env...),
		append([]string{"relay", "--schema", s.Name, "--topic", topic, "--origin", "comandes", "--poll", "50ms"}, sec.flags...)...)
	if got := kafkatest.ReadAllWith(t, sec.b.Broker, sec.b.Opts(t), topic, 20, 30*time.Second); len(got) != 20 {
		t.Fatalf("the relay published %d of 20 rows over SASL_SSL\n%s", len(got), relayProc.log())
	}

	// km0 lag, the password from a file this time: a group that committed
	// offset 0 everywhere lags by the 20 records.
	offs := kadm.Offsets{}
	for p := range int32(kafka.PartitionsDefault) {
		offs.Add(kadm.Offset{Topic: topic, Partition: p, At: 0, LeaderEpoch: -1})
	}
	if resp, err := sec.adm.CommitOffsets(ctx, "km0-sec-test", offs); err != nil || resp.Error() != nil {
		t.Fatalf("commit offsets: %v %v", err, resp.Error())
	}
	pwFile := writeFile(t, "kafka-password", sec.b.Security.SASLPassword+"\n")
	out, errOut, err := runKm0(t, nil, append([]string{"lag", "--json", "--consumer-groups", "km0-sec-test",
		"--kafka-sasl-password-file", pwFile}, sec.flags...)...)
	sec.noPassword(t, "km0 lag", out+errOut)
	if err != nil {
		t.Fatalf("km0 lag over SASL_SSL: %v\n%s%s", err, out, errOut)
	}
	var snap lag.Snapshot
	if err := json.Unmarshal([]byte(out), &snap); err != nil {
		t.Fatalf("km0 lag --json: %v\n%s", err, out)
	}
	if len(snap.Groups) != 1 || snap.Groups[0].Total != 20 || len(snap.Errors) != 0 {
		t.Fatalf("km0 lag: want group km0-sec-test with lag 20, got %+v (errors %v)", snap.Groups, snap.Errors)
	}

	// km0 dlq ls: the index synced from the DLQ topics over SASL_SSL.
	out, errOut, err = runKm0(t, sec.env, append([]string{"dlq", "ls", "--database-url", s.URL, "--schema", s.Name}, sec.flags...)...)
	sec.noPassword(t, "km0 dlq ls", out+errOut)
	if err != nil {
		t.Fatalf("km0 dlq ls over SASL_SSL: %v\n%s%s", err, out, errOut)
	}

	// km0 serve inventari: its consumer group joins through SASL_SSL.
	serveProc := startKm0(t, append([]string{serviceDatabaseEnv(inventari.Name) + "=" + pgtest.NewDatabase(t)}, sec.env...),
		append([]string{"serve", inventari.Name}, sec.flags...)...)
	serveProc.waitRunning(t, 60*time.Second)
	waitGroup(t, sec.adm, inventari.ConsumerDecrement, "stable with one member", func(g kadm.DescribedGroup) bool {
		return g.State == "Stable" && len(g.Members) == 1
	})

	// km0 console: its DLQ indexer joins its group, and its lag sampler
	// measures km0-sec-test, through SASL_SSL.
	consoleProc := startKm0(t, sec.env, append([]string{"console", "--http-addr", "127.0.0.1:0", "--database-url", s.URL,
		"--schema", s.Name, "--consumer-groups", "km0-sec-test"}, sec.flags...)...)
	waitGroup(t, sec.adm, kafkadlq.GroupDefault, "stable with one member", func(g kadm.DescribedGroup) bool {
		return g.State == "Stable" && len(g.Members) == 1
	})
	metrics := consoleMetrics(t, consoleProc, `km0_lag_sample_errors 0`)
	var parts, total int
	for _, line := range strings.Split(metrics, "\n") {
		if strings.HasPrefix(line, `km0_consumer_group_lag{grup="km0-sec-test",`) && strings.Contains(line, `topic="`+topic+`"}`) {
			n, err := strconv.Atoi(line[strings.LastIndexByte(line, ' ')+1:])
			if err != nil {
				t.Fatalf("metric line %q: %v", line, err)
			}
			parts, total = parts+1, total+n
		}
	}
	if parts != kafka.PartitionsDefault || total != 20 {
		t.Fatalf("the console measured %d partitions of km0-sec-test with lag %d, want %d and 20:\n%s", parts, total, kafka.PartitionsDefault, metrics)
	}
	for _, p := range []struct {
		what string
		p    *proc
	}{{"km0 relay", relayProc}, {"km0 serve", serveProc}, {"km0 console", consoleProc}} {
		sec.noPassword(t, p.what, p.p.log())
		if !strings.Contains(p.p.log(), "SASL_SSL SCRAM-SHA-512 user km0") {
			t.Errorf("%s does not log the Kafka security it uses:\n%s", p.what, p.p.log())
		}
	}
}

// consoleMetrics polls the /metrics of the console p runs until they hold
// want, and returns them.
func consoleMetrics(t *testing.T, p *proc, want string) string {
	t.Helper()
	var last string
	testkit.Eventuallyf(t, 30*time.Second, fmt.Sprintf("%q on the console's /metrics", want), func() (bool, string) {
		if _, rest, ok := strings.Cut(p.log(), "console at "); ok {
			url, _, _ := strings.Cut(rest, "/ ")
			if resp, err := http.Get(url + "/metrics"); err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				last = string(b)
			}
		}
		return strings.Contains(last, want), last + "\n" + p.log()
	})
	return last
}

// A wrong password, an unknown CA and a password flag end a command at
// start with an error naming the cause, never quoting the password.
func TestCommandsRefuseABadKafkaSecurityNamingTheCause(t *testing.T) {
	t.Parallel()
	sec := newSecured(t)
	wrong := "wrong-" + sec.b.Security.SASLPassword
	other := kafkatest.NewPKI(t, kafkatest.PKIOptions{}).CAFile
	for _, c := range []struct {
		name string
		env  []string
		args []string
		want string
	}{
		{"wrong password", []string{"KM0_KAFKA_SASL_PASSWORD=" + wrong}, sec.flags, "SASL authentication failed"},
		{"unknown CA", sec.env, append(append([]string(nil), sec.flags...), "--kafka-tls-ca-file", other), "x509: certificate signed by unknown authority"},
		{"password flag", nil, append([]string{"--kafka-sasl-password", wrong}, sec.flags...), "--kafka-sasl-password is not accepted"},
		{"no password", nil, sec.flags, "SASL SCRAM-SHA-512 needs a password"},
		{"unknown mechanism", sec.env, append(append([]string(nil), sec.flags...), "--kafka-sasl-mechanism", "GSSAPI"), `unknown SASL mechanism "GSSAPI"`},
	} {
		out, errOut, err := runKm0(t, c.env, append([]string{"lag", "--consumer-groups", "g"}, c.args...)...)
		var exit *exec.ExitError
		if !errors.As(err, &exit) || !strings.Contains(errOut, c.want) {
			t.Errorf("%s: km0 lag: %v, want an exit naming %q:\n%s%s", c.name, err, c.want, out, errOut)
		}
		if strings.Contains(out+errOut, wrong) || strings.Contains(out+errOut, sec.b.Security.SASLPassword) {
			t.Errorf("%s: km0 lag printed the password:\n%s%s", c.name, out, errOut)
		}
	}
	// km0 relay too, before it touches the outbox's rows.
	s := pgtest.NewMigratedSchema(t)
	out, errOut, err := runKm0(t, []string{"KM0_KAFKA_SASL_PASSWORD=" + wrong, "KM0_DATABASE_URL=" + pgtest.URL()},
		append([]string{"relay", "--schema", s.Name, "--topic", "comandes.esdeveniments", "--origin", "comandes"}, sec.flags...)...)
	if err == nil || !strings.Contains(errOut, "SASL authentication failed") || strings.Contains(out+errOut, wrong) {
		t.Errorf("km0 relay with a wrong password: %v, want an exit naming SASL authentication, without the password:\n%s%s", err, out, errOut)
	}
}

// --help lists every Kafka security flag and no default of a secret: not
// the password of $KM0_KAFKA_SASL_PASSWORD.
//
// Not parallel: t.Setenv, for the environment the flag set ($KM0_KAFKA_*)
// reads in this process.
func TestKafkaSecurityFlagsHelpShowsNoSecret(t *testing.T) {
	t.Setenv("KM0_KAFKA_SASL_PASSWORD", password)
	t.Setenv("KM0_KAFKA_TLS", "true")
	fs := cli.NewFlags("x", "test")
	var out bytes.Buffer
	fs.SetOutput(&out)
	k := cli.KafkaSecurityFlags(fs)
	if err := cli.Parse(fs, []string{"--help"}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	for _, f := range []string{"kafka-tls", "kafka-tls-ca-file", "kafka-tls-cert-file", "kafka-tls-key-file", "kafka-tls-server-name",
		"kafka-tls-insecure-skip-verify", "kafka-sasl-mechanism", "kafka-sasl-username", "kafka-sasl-password-file", "kafka-sasl-oauth-token-file"} {
		if !strings.Contains(out.String(), "-"+f+" ") && !strings.Contains(out.String(), "-"+f+"\n") {
			t.Errorf("--help lacks --%s:\n%s", f, out.String())
		}
	}
	if strings.Contains(out.String(), password) {
		t.Fatalf("--help shows the password:\n%s", out.String())
	}
	if sec := k.Security(nil); !sec.TLS || sec.SASLPassword != password {
		t.Fatalf("the environment is not the default: TLS %v, password set %v", sec.TLS, sec.SASLPassword == password)
	}
	t.Setenv("KM0_KAFKA_TLS", "maybe")
	fs = cli.NewFlags("x", "test")
	out.Reset()
	fs.SetOutput(&out)
	cli.KafkaSecurityFlags(fs)
	if err := cli.Parse(fs, nil); !errors.Is(err, cli.ErrUsage) || !strings.Contains(out.String(), "$KM0_KAFKA_TLS: want true or false") {
		t.Fatalf("KM0_KAFKA_TLS=maybe: %v %s", err, out.String())
	}
}
