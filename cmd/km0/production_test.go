package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/outbox"
)

// passwordRole creates role km0 on the cluster with a fresh password
// (LOGIN CREATEDB REPLICATION, not a superuser: what a managed PostgreSQL
// grants) and database km0relay owned by it, and returns the password and
// the URL of database db as km0, verify-full with the cluster's CA.
func (tc *tlsCluster) passwordRole(t *testing.T) (password string, dbURL func(db string) string) {
	t.Helper()
	password = rand.Text()
	admin := pgtest.NewPool(t, tc.c.URL, 1)
	for _, q := range []string{"CREATE ROLE km0 LOGIN CREATEDB REPLICATION PASSWORD '" + password + "'", "CREATE DATABASE km0relay OWNER km0"} {
		if _, err := admin.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	return password, func(db string) string {
		u, _ := url.Parse(tc.c.URL)
		u.User, u.Path = url.UserPassword("km0", password), "/"+db
		return u.String()
	}
}

// The production combination at once: a private PostgreSQL that takes
// TLS only (sslmode=verify-full with a test CA, role km0 authenticated by a
// password, no superuser) and kfake with SASL SCRAM-SHA-512 over TLS, both
// secrets only in the environment. As processes: `km0 serve NAME` for each
// of the six services (with --authorize: request/reply over the secured
// Kafka too), one order placed over comandes' HTTP API flows end to end
// (paid, 2 units of stock taken, assigned, counted by analitica: read in
// the services' databases over TLS); `km0 relay` polling then `--mode cdc`
// publish 10 + 10 rows of an outbox of the test's own; `km0 dlq ls`, `km0
// lag --json` and `km0 console` (GET /metrics) each reach both. Every
// connection to the services' databases is over TLS, and no output shows
// the SASL password or the PostgreSQL password.
func TestProductionConnectionsEveryCommandAsAProcess(t *testing.T) {
	t.Parallel()
	const relayTopic = "km0test.relay"
	tc := startTLSCluster(t)
	pgPassword, dbURL := tc.passwordRole(t)
	sec := newSecured(t, append(system.DomainTopics(), relayTopic)...)
	admin := dbURL("postgres")
	secret := func(what, out string) {
		t.Helper()
		sec.noPassword(t, what, out)
		if strings.Contains(out, pgPassword) {
			t.Fatalf("%s printed the PostgreSQL password:\n%s", what, out)
		}
	}
	ctx := context.Background()

	// km0 serve NAME, six processes; each creates km0_<service> on the
	// server through the admin URL and joins its consumer groups.
	env := append([]string{"KM0_DATABASE_URL=" + admin, testSigningKeyEnv}, sec.env...)
	addr := freeAddr(t)
	procs := map[string]*proc{}
	for _, service := range system.Services {
		args := append([]string{"serve", service, "--authorize"}, sec.flags...)
		if service == comandes.Name {
			args = append(args, "--http", "comandes="+addr)
		}
		procs["km0 serve "+service] = startKm0(t, env, args...)
	}
	for what, p := range procs {
		select {
		case <-p.running:
		case <-p.exited:
			t.Fatalf("%s exited before running: %v\n%s", what, p.err, p.log())
		case <-time.After(90 * time.Second):
			t.Fatalf("%s not running after 90 s\n%s", what, p.log())
		}
	}
	for _, group := range system.ConsumerNames {
		waitGroup(t, sec.adm, group, "stable", func(g kadm.DescribedGroup) bool { return g.State == "Stable" && len(g.Members) >= 1 })
	}

	// One order, retried while pagaments' replies are not yet flowing (503).
	body := `{"id":"P-2026-000023","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":2,"preu_centims":300}],` +
		`"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`
	deadline := time.Now().Add(60 * time.Second)
	for {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/comandes", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "k-produccio")
		resp, err := http.DefaultClient.Do(req)
		status := 0
		if err == nil {
			status = resp.StatusCode
			resp.Body.Close()
		}
		if status == http.StatusCreated {
			break
		}
		if time.Now().After(deadline) || (err == nil && status != http.StatusServiceUnavailable) {
			t.Fatalf("POST /comandes: %d %v\n%s", status, err, procs["km0 serve comandes"].log())
		}
		time.Sleep(100 * time.Millisecond) // the client's pause between retries
	}
	pools := map[string]*pgxpool.Pool{}
	for _, service := range system.Services {
		pools[service] = pgtest.NewPool(t, dbURL("km0_"+service), 1)
	}
	one := func(service, q string) int {
		var n int
		if err := pools[service].QueryRow(ctx, q).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	testkit.Eventually(t, time.Minute, "the order paid, its stock taken, its delivery assigned and analitica's counts", func() bool {
		return one("comandes", `SELECT count(*) FROM comandes WHERE id = 'P-2026-000023' AND estat = 'pagada'`) == 1 &&
			one("inventari", `SELECT unitats FROM estoc WHERE producte = 'carbasso'`) == 80-2 &&
			one("pagaments", `SELECT count(*) FROM pagaments WHERE comanda_id = 'P-2026-000023'`) == 1 &&
			one("repartiment", `SELECT count(*) FROM lliuraments WHERE comanda_id = 'P-2026-000023' AND estat = 'assignat'`) == 1 &&
			one("analitica", `SELECT coalesce(sum(n) FILTER (WHERE tipus = 'comanda.creada'), 0) FROM comptadors_tipus`) == 1 &&
			one("analitica", `SELECT coalesce(sum(n) FILTER (WHERE tipus = 'comanda.pagada'), 0) FROM comptadors_tipus`) == 1
	})

	for _, service := range system.Services {
		if all, ssl := tc.sslConnections(t, "km0_"+service); all == 0 || ssl != all {
			t.Errorf("connections to km0_%s: %d, over TLS %d; want the service's, all over TLS", service, all, ssl)
		}
	}

	// km0 migrate, then km0 relay polling and --mode cdc on km0relay.
	relayDB := dbURL("km0relay")
	if out, err := runKm0Combined(t, []string{"KM0_DATABASE_URL=" + relayDB}, "migrate"); err != nil {
		t.Fatalf("km0 migrate: %v\n%s", err, out)
	} else {
		secret("km0 migrate", out)
	}
	// The password is checked (scram-sha-256, not trust): a wrong one ends
	// km0 migrate naming the cause, without quoting it.
	wrong := strings.Replace(relayDB, url.UserPassword("km0", pgPassword).String(), url.UserPassword("km0", "wrong-"+pgPassword).String(), 1)
	if wrong == relayDB {
		t.Fatal("test: the password is not in the URL")
	}
	if out, err := runKm0Combined(t, []string{"KM0_DATABASE_URL=" + wrong}, "migrate"); err == nil ||
		!strings.Contains(out, "password authentication failed") || strings.Contains(out, pgPassword) {
		t.Fatalf("km0 migrate with a wrong password: %v, want a failure naming the password authentication, without it:\n%s", err, out)
	}
	pool := pgtest.NewPool(t, relayDB, 1)
	ob := outbox.New(outbox.Config{})
	enqueue := func(from int) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for i := from; i < from+10; i++ {
			if err := ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "prova", AggregateID: fmt.Sprint("R-", i%3), Type: "prova.feta",
				Payload: map[string]int{"i": i}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	relayEnv := append([]string{"KM0_DATABASE_URL=" + relayDB}, sec.env...)
	for i, args := range [][]string{{"--mode", "polling", "--poll", "50ms"}, {"--mode", "cdc"}} {
		mode := args[1]
		enqueue(10 * i)
		p := startKm0(t, relayEnv, append(append([]string{"relay", "--topic", relayTopic, "--origin", "proves"}, args...), sec.flags...)...)
		procs["km0 relay --mode "+mode] = p
		if got := kafkatest.ReadAllWith(t, sec.b.Broker, sec.b.Opts(t), relayTopic, 10*(i+1), 30*time.Second); len(got) != 10*(i+1) {
			t.Fatalf("km0 relay --mode %s: %d records on %s, want %d\n%s", mode, len(got), relayTopic, 10*(i+1), p.log())
		}
		testkit.Eventually(t, time.Minute, "km0 relay --mode "+mode+" marked its rows", func() bool {
			var pending int
			return pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL").Scan(&pending) == nil && pending == 0
		})

		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		<-p.exited
	}

	// km0 dlq ls: the index on km0relay, synced from the DLQ topics: the
	// one letter the test dead-lettered.
	letter := &kgo.Record{Topic: contract.DLQName(comandes.Topic), Key: []byte("P-9"), Value: []byte(`{"x":1}`), Headers: []kgo.RecordHeader{
		{Key: "intents", Value: []byte("1")}, {Key: "motiu", Value: []byte("permanent: prova")}, {Key: "topic_original", Value: []byte(comandes.Topic)}}}
	if err := kafkatest.Client(t, sec.b.Broker, sec.b.Opts(t)...).ProduceSync(ctx, letter).FirstErr(); err != nil {
		t.Fatal(err)
	}
	out, errOut, err := runKm0(t, relayEnv, append([]string{"dlq", "ls"}, sec.flags...)...)
	secret("km0 dlq ls", out+errOut)
	if err != nil || !strings.Contains(out, "1 dead letter(s)") || !strings.Contains(out, "permanent: prova") {
		t.Fatalf("km0 dlq ls: %v, want the one letter\n%s%s", err, out, errOut)
	}

	// km0 lag --json: every group of the system, measured without an error.
	out, errOut, err = runKm0(t, relayEnv, append([]string{"lag", "--json", "--consumer-groups", strings.Join(system.ConsumerNames, ",")}, sec.flags...)...)
	secret("km0 lag", out+errOut)
	var snap lag.Snapshot
	if err != nil || json.Unmarshal([]byte(out), &snap) != nil {
		t.Fatalf("km0 lag --json: %v\n%s%s", err, out, errOut)
	}
	if len(snap.Groups) != len(system.ConsumerNames) || len(snap.Errors) != 0 {
		t.Fatalf("km0 lag: %d groups (errors %v), want %d without errors", len(snap.Groups), snap.Errors, len(system.ConsumerNames))
	}

	// km0 console: its DLQ indexer's group and its lag sampler over SASL_SSL.
	console := startKm0(t, relayEnv, append([]string{"console", "--http-addr", "127.0.0.1:0", "--consumer-groups", strings.Join(system.ConsumerNames, ",")}, sec.flags...)...)
	procs["km0 console"] = console
	waitGroup(t, sec.adm, kafkadlq.GroupDefault, "stable with one member", func(g kadm.DescribedGroup) bool {
		return g.State == "Stable" && len(g.Members) == 1
	})
	metrics := consoleMetrics(t, console, `km0_lag_sample_errors 0`)
	if !strings.Contains(metrics, `km0_consumer_group_lag{grup="`+system.ConsumerNames[0]+`",`) {
		t.Fatalf("the console's /metrics lack the lag of %s:\n%s", system.ConsumerNames[0], metrics)
	}
	secret("GET /metrics", metrics)

	for what, p := range procs {
		secret(what, p.log()+p.output())
		if !strings.Contains(p.log(), "SASL_SSL SCRAM-SHA-512 user km0") {
			t.Errorf("%s does not log the Kafka security it uses:\n%s", what, p.log())
		}
	}
}
