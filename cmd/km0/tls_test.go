package main

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/tlstest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport/amqp"
)

// tlsCluster is a private PostgreSQL cluster that takes TCP over TLS only
// (plain TCP refused), with a role km0_cert that authenticates by client
// certificate and owns database km0tls; a role km0, when a test creates it
// (passwordRole), authenticates by its password.
type tlsCluster struct {
	c        *pgcluster.Cluster
	ca       *tlstest.CA
	certUser tlstest.Pair
}

func startTLSCluster(t *testing.T) *tlsCluster {
	t.Helper()
	ca := tlstest.NewCA(t, "km0 test CA")
	srv := ca.Server(t, "127.0.0.1", "localhost")
	c, err := pgcluster.Start(pgcluster.Options{TLS: &pgcluster.TLS{CertFile: srv.CertFile, KeyFile: srv.KeyFile, CAFile: ca.CertFile,
		CertUsers: []string{"km0_cert"}, PasswordUsers: []string{"km0"}}})
	if err != nil {
		t.Fatalf("a private PostgreSQL cluster with TLS is required: %v", err)
	}
	t.Cleanup(c.Stop)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	for _, q := range []string{"CREATE ROLE km0_cert LOGIN", "CREATE DATABASE km0tls OWNER km0_cert"} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	return &tlsCluster{c: c, ca: ca, certUser: ca.Client(t, "km0_cert")}
}

// certURL is km0tls as km0_cert, verify-full, authenticated by its
// client certificate (no password).
func (tc *tlsCluster) certURL() string {
	u, _ := url.Parse(tc.c.URL)
	u.User, u.Path = url.User("km0_cert"), "/km0tls"
	q := u.Query()
	q.Set("sslcert", tc.certUser.CertFile)
	q.Set("sslkey", tc.certUser.KeyFile)
	u.RawQuery = q.Encode()
	return u.String()
}

// sslConnections counts the server's client backends on database db, and
// those of them over TLS.
func (tc *tlsCluster) sslConnections(t *testing.T, db string) (all, ssl int) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, tc.c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	err = conn.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
		WHERE a.datname = $1 AND a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()`, db).Scan(&all, &ssl)
	if err != nil {
		t.Fatal(err)
	}
	return all, ssl
}

// runKm0Combined runs `km0 args...` as a process to its end, with env
// added (runKm0), and returns its stdout and stderr together.
func runKm0Combined(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	out, errOut, err := runKm0(t, env, args...)
	return out + errOut, err
}

// km0 migrate and km0 relay (polling, then cdc) as processes against PostgreSQL with
// sslmode=verify-full, authenticated by a client certificate, the relay
// publishing to RabbitMQ over amqps:// (--amqp-tls-ca-file, a client
// certificate, --amqp-tls-server-name): every row reaches the queue and is
// marked. A CA that did not sign the server's certificate fails km0 migrate
// at once, naming the cause.
func TestMigrateAndRelayOverTLS(t *testing.T) {
	t.Parallel()
	tc := startTLSCluster(t)
	rabbit := amqptest.NewTLSBroker(t, true)
	client := rabbit.CA.Client(t, "km0-relay")
	dbURL := tc.certURL()

	out, err := runKm0Combined(t, []string{"KM0_DATABASE_URL=" + dbURL}, "migrate")
	if err != nil || !strings.Contains(out, "file(s) applied") {
		t.Fatalf("km0 migrate over TLS: %v\n%s", err, out)
	}
	other := tlstest.NewCA(t, "another CA")
	wrong := strings.Replace(dbURL, url.QueryEscape(tc.ca.CertFile), url.QueryEscape(other.CertFile), 1)
	if wrong == dbURL {
		t.Fatal("test: the CA path is not in the URL")
	}
	start := time.Now()
	out, err = runKm0Combined(t, []string{"KM0_DATABASE_URL=" + wrong}, "migrate")
	if err == nil || !strings.Contains(out, "certificate signed by unknown authority") || time.Since(start) > 20*time.Second {
		t.Fatalf("km0 migrate with another CA: want a failure naming the unknown authority at once, got %v after %v\n%s", err, time.Since(start), out)
	}

	ctx := context.Background()
	pool := pgtest.NewPool(t, dbURL, 2)
	ob := outbox.New(outbox.Config{})
	enqueue := func(n int) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for i := range n {
			if err := ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: fmt.Sprint("P-", i%3), Type: "comanda.creada",
				Payload: map[string]int{"i": i}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	const rows = 20
	enqueue(rows)
	conn := amqptest.Dial(t)
	exchange, queue := amqptest.Name("km0.test.tlsrelay"), amqptest.Name("km0.test.tlsrelay.q")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{queue} })
	if err := conn.Declare(ctx, amqp.Topology{
		Exchanges: []amqp.Exchange{{Name: exchange, Kind: "topic", Durable: true}},
		Queues:    []amqp.Queue{{Name: queue, Durable: true}},
		Bindings:  []amqp.Binding{{Queue: queue, Exchange: exchange, Key: "comandes.esdeveniments"}},
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Do(context.Background(), func(ch *amqp091.Channel) error { return ch.ExchangeDelete(exchange, false, false) })
	})
	relay := startKm0(t, []string{"KM0_DATABASE_URL=" + dbURL, "KM0_AMQP_URL=" + rabbit.URL},
		"relay", "--mode", "polling", "--topic", "comandes.esdeveniments", "--origin", "comandes", "--exchange", exchange,
		"--amqp-tls-ca-file", rabbit.CA.CertFile, "--amqp-tls-cert-file", client.CertFile, "--amqp-tls-key-file", client.KeyFile,
		"--amqp-tls-server-name", rabbit.ServerName)
	testkit.Eventually(t, time.Minute, "every row published over TLS and marked", func() bool {
		select {
		case <-relay.exited:
			t.Fatalf("km0 relay exited: %v\n%s", relay.err, relay.log())
		default:
		}
		var pending int
		return pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL").Scan(&pending) == nil && pending == 0 &&
			amqptest.QueueLen(t, conn, queue) == rows
	})

	if all, ssl := tc.sslConnections(t, "km0tls"); all == 0 || ssl != all {
		t.Fatalf("connections to km0tls: %d, over TLS %d; want all of them, at least the relay's", all, ssl)
	}
	if rabbit.Proxy.Accepted() == 0 {
		t.Fatal("the relay did not connect through the TLS proxy")
	}
	if strings.Contains(relay.log(), "guest:guest") {
		t.Fatalf("the relay logged the broker's password:\n%s", relay.log())
	}
	_ = relay.cmd.Process.Signal(syscall.SIGTERM)
	<-relay.exited

	// The CDC relay: its replication connection takes the same TLS
	// parameters (as postgres: it needs REPLICATION).
	enqueue(rows)
	adminURL := strings.Replace(tc.c.URL, "/postgres?", "/km0tls?", 1)
	cdcRelay := startKm0(t, []string{"KM0_DATABASE_URL=" + adminURL, "KM0_AMQP_URL=" + rabbit.URL, "KM0_AMQP_TLS_CA_FILE=" + rabbit.CA.CertFile,
		"KM0_AMQP_TLS_CERT_FILE=" + client.CertFile, "KM0_AMQP_TLS_KEY_FILE=" + client.KeyFile},
		"relay", "--mode", "cdc", "--topic", "comandes.esdeveniments", "--origin", "comandes", "--exchange", exchange)
	testkit.Eventually(t, time.Minute, "the CDC relay published the new rows over TLS and marked them", func() bool {
		select {
		case <-cdcRelay.exited:
			t.Fatalf("km0 relay --mode cdc exited: %v\n%s", cdcRelay.err, cdcRelay.log())
		default:
		}
		var pending int
		return pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL").Scan(&pending) == nil && pending == 0 &&
			amqptest.QueueLen(t, conn, queue) == 2*rows
	})

	admin := pgtest.NewPool(t, tc.c.URL, 1)
	var walsenders int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
		WHERE a.backend_type = 'walsender' AND s.ssl`).Scan(&walsenders); err != nil || walsenders != 1 {
		t.Fatalf("replication connections over TLS: %d (%v), want 1", walsenders, err)
	}
}

// km0 serve cataleg as a process, given an admin connection string in the
// keyword/value form with sslmode=verify-full and sslrootcert, and RabbitMQ
// over amqps:// with the CA from KM0_AMQP_TLS_CA_FILE: the database
// km0_cataleg it derives is created, migrated and used over TLS (the
// server refuses plain TCP). It runs on a vhost of its own (amqptest.NewVHost).
func TestServeOverTLSDerivesItsDatabaseWithTheTLSParameters(t *testing.T) {
	t.Parallel()
	tc := startTLSCluster(t)
	rabbit := amqptest.NewTLSBroker(t, false)
	amqpURL := amqptest.OnVHost(rabbit.URL, amqptest.NewVHost(t)) // deleted, with all in it, after the process stops
	name := amqptest.Name("km0.test.tlsserve")
	exchange, prefix := name+".esdeveniments", name+"."
	admin := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=postgres sslmode=verify-full sslrootcert='%s'", tc.c.Port, tc.ca.CertFile)
	cataleg := startKm0(t, []string{"KM0_DATABASE_URL=" + admin, "KM0_AMQP_URL=" + amqpURL, "KM0_AMQP_TLS_CA_FILE=" + rabbit.CA.CertFile},
		"serve", "cataleg", "--events", "rabbitmq", "--events-exchange", exchange, "--events-queue-prefix", prefix)
	cataleg.waitRunning(t, 60*time.Second)
	pool := pgtest.NewPool(t, strings.Replace(tc.c.URL, "/postgres?", "/km0_cataleg?", 1), 2)
	var tables int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").Scan(&tables); err != nil || tables == 0 {
		t.Fatalf("km0_cataleg: %d tables (%v); want it migrated", tables, err)
	}
	if all, ssl := tc.sslConnections(t, "km0_cataleg"); all == 0 || ssl != all {
		t.Fatalf("connections to km0_cataleg: %d, over TLS %d; want the service's, all over TLS", all, ssl)
	}
	if rabbit.Proxy.Accepted() == 0 {
		t.Fatal("km0 serve did not connect to RabbitMQ through the TLS proxy")
	}
}
