package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/doctor"
	"github.com/km0/km0/internal/kafkaacl"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgbouncer"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

// doctorRun is one `km0 doctor --json` run: its findings, output and exit.
type doctorRun struct {
	rows           []doctor.Finding
	stdout, stderr string
	err            error
}

func runDoctorJSON(t *testing.T, env []string, args ...string) doctorRun {
	t.Helper()
	out, errOut, err := runKm0(t, env, append([]string{"doctor", "--json", "--timeout", "10s"}, args...)...)
	d := doctorRun{stdout: out, stderr: errOut, err: err}
	if jerr := json.Unmarshal([]byte(out), &d.rows); jerr != nil {
		t.Fatalf("km0 doctor --json printed no JSON array (%v):\n%s\n%s", jerr, out, errOut)
	}
	return d
}

// failures returns the FAIL rows as "check target: seen".
func (d doctorRun) failures() []string {
	var out []string
	for _, f := range d.rows {
		if f.Result == doctor.ResultFail {
			out = append(out, f.Check+" "+f.Target+": "+f.Seen)
		}
	}
	return out
}

// only fails the test unless the run failed (exit 1) with exactly the
// checks of want failing, each one's seen text holding its substring, and
// a fix for each.
func (d doctorRun) only(t *testing.T, want map[string]string) {
	t.Helper()
	if d.err == nil {
		t.Fatalf("km0 doctor exited 0 on a broken deployment:\n%s", d.stdout)
	}
	got := map[string]doctor.Finding{}
	for _, f := range d.rows {
		if f.Result == doctor.ResultFail {
			got[f.Check+" "+f.Target] = f
		}
	}
	if len(got) != len(want) {
		t.Fatalf("%d failures, want %d (%v):\n%s", len(got), len(want), mapKeys(want), strings.Join(d.failures(), "\n"))
	}
	for k, sub := range want {
		f, ok := got[k]
		if !ok || !strings.Contains(f.Seen, sub) || f.Fix == "" {
			t.Fatalf("want failure %q seen %q with a fix; got:\n%s", k, sub, strings.Join(d.failures(), "\n"))
		}
	}
}

func mapKeys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// `km0 doctor` runs as a process against a correct deployment (PostgreSQL
// with wal_level = logical for --relay cdc, kfake with SASL SCRAM-SHA-512
// over TLS, the contract's topics with 14 days of retention and every
// service's minimal ACLs) and prints only ok,
// exit 0; against each broken one it exits 1 naming the one fault: a wrong
// Kafka password, wal_level = replica, a missing topic, LISTEN broken by a
// transaction-pooling PgBouncer, pagaments' principal without the ACL of its
// group, a slot whose WAL was removed (lost). The
// credentials never show in what it prints.
func TestDoctorNamesEachFault(t *testing.T) {
	t.Parallel()
	good, err := pgcluster.Start(pgcluster.Options{Settings: map[string]string{
		"max_slot_wal_keep_size": "1MB", "wal_keep_size": "0", "max_wal_size": "32MB", "min_wal_size": "32MB"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(good.Stop)
	replica, err := pgcluster.Start(pgcluster.Options{Settings: map[string]string{"wal_level": "replica", "max_wal_senders": "0"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(replica.Stop)
	topics := append(system.DomainTopics(), pagaments.AuthQueue, inventari.ReserveQueue)
	s := newSecured(t, topics...)
	ctx := context.Background()
	retention := strconv.FormatInt(kafka.RetentionDefault.Milliseconds(), 10)
	resp, err := s.adm.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Op: kadm.SetConfig, Name: "retention.ms", Value: &retention}}, topics...)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range resp {
		if r.Err != nil {
			t.Fatalf("retention of %s: %v", r.Name, r.Err)
		}
	}
	acls := system.RequiredACLs(system.ACLOptions{})
	aclRequest(t, s, kmsg.NewPtrCreateACLsRequest(), acls)
	cdc := append([]string{"--relay", "cdc", "--database-url", good.URL}, s.flags...)

	t.Run("correct deployment", func(t *testing.T) {
		d := runDoctorJSON(t, s.env, cdc...)
		if d.err != nil || len(d.failures()) > 0 {
			t.Fatalf("km0 doctor on a correct deployment: %v\n%s\n%s", d.err, d.stdout, d.stderr)
		}
		want := map[string]int{"postgres connection": 1, "postgres version": 1, "postgres wal_level": 1, "postgres privileges": 1,
			"postgres slots": 1, "postgres clock": 1, "kafka connection": 1, "kafka topic": len(topics), "kafka ACLs": len(system.Services) + 1}
		got := map[string]int{}
		for _, f := range d.rows {
			if f.Result != doctor.ResultOK {
				t.Fatalf("%s %s: %s %s (want ok)", f.Check, f.Target, f.Result, f.Seen)
			}
			got[f.Check]++
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("checks %v, want %v", got, want)
		}
		s.noPassword(t, "km0 doctor", d.stdout+d.stderr)
		// The table form: one header, one line per check, the same exit.
		out, _, err := runKm0(t, s.env, append([]string{"doctor"}, cdc...)...)
		if err != nil || !strings.HasPrefix(out, "CHECK") || !strings.Contains(out, fmt.Sprintf("%d checks: 0 failed", len(d.rows))) {
			t.Fatalf("table: %v\n%s", err, out)
		}
	})

	t.Run("wrong Kafka password", func(t *testing.T) {
		const wrong = "not-the-password-4f1c"
		d := runDoctorJSON(t, []string{"KM0_KAFKA_SASL_PASSWORD=" + wrong}, cdc...)
		d.only(t, map[string]string{"kafka connection " + strings.Join(s.b.Addrs(), ","): "SASL authentication failed"})
		if strings.Contains(d.stdout+d.stderr, wrong) {
			t.Fatalf("km0 doctor printed the password:\n%s", d.stdout)
		}
	})

	t.Run("wal_level replica", func(t *testing.T) {
		args := append([]string{"--relay", "cdc", "--database-url", replica.URL}, s.flags...)
		d := runDoctorJSON(t, s.env, args...)
		d.only(t, map[string]string{"postgres wal_level 127.0.0.1:" + strconv.Itoa(replica.Port) + "/postgres": "replica"})
	})

	t.Run("missing topic", func(t *testing.T) {
		gone := contract.DLQName(pagaments.Topic)
		if _, err := s.adm.DeleteTopics(ctx, gone); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if _, err := s.adm.CreateTopics(ctx, kafka.PartitionsDefault, 1, map[string]*string{"retention.ms": &retention}, gone); err != nil {
				t.Error(err)
			}
		})
		d := runDoctorJSON(t, s.env, cdc...)
		d.only(t, map[string]string{"kafka topic " + gone: "missing"})
	})

	t.Run("missing ACL", func(t *testing.T) {
		// pagaments may no longer join its group pagaments.cobrament.
		var gone kafkaacl.ACL
		for _, a := range acls {
			if a.Principal == kafkaacl.PrincipalFor(pagaments.Name) && a.ResourceType == kafkaacl.ResourceGroup {
				gone = a
			}
		}
		aclRequest(t, s, kmsg.NewPtrDeleteACLsRequest(), []kafkaacl.ACL{gone})
		t.Cleanup(func() { aclRequest(t, s, kmsg.NewPtrCreateACLsRequest(), []kafkaacl.ACL{gone}) })
		d := runDoctorJSON(t, s.env, cdc...)
		d.only(t, map[string]string{"kafka ACLs " + gone.Principal: "missing: Read on group " + gone.ResourceName})
	})

	t.Run("LISTEN through a transaction pooler", func(t *testing.T) {
		b, err := pgbouncer.Start(pgbouncer.Options{Upstream: "127.0.0.1:" + strconv.Itoa(good.Port), Mode: pgbouncer.Transaction, PoolSize: 2})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(b.Stop)
		d := runDoctorJSON(t, s.env, append([]string{"--relay", "polling", "--listen-wait", "2s", "--database-url", b.URL("postgres")}, s.flags...)...)
		d.only(t, map[string]string{"postgres LISTEN 127.0.0.1:" + strconv.Itoa(b.Port) + "/postgres": "never arrived"})
	})

	t.Run("lost slot", func(t *testing.T) {
		const slot = "km0_postgres_public_outbox"
		loseSlot(t, good.URL, slot)
		d := runDoctorJSON(t, s.env, cdc...)
		d.only(t, map[string]string{"postgres slot 127.0.0.1:" + strconv.Itoa(good.Port) + "/postgres slot " + slot: "wal_status lost"})
	})
}

// aclRequest creates (a CreateACLsRequest) or deletes (a DeleteACLsRequest)
// acls on s's broker, failing the test on an error.
func aclRequest(t *testing.T, s *secured, req kmsg.Request, acls []kafkaacl.ACL) {
	t.Helper()
	for _, a := range acls {
		rt, err1 := kmsg.ParseACLResourceType(a.ResourceType)
		pt, err2 := kmsg.ParseACLResourcePatternType(a.Pattern)
		op, err3 := kmsg.ParseACLOperation(a.Operation)
		if err := errors.Join(err1, err2, err3); err != nil {
			t.Fatal(err)
		}
		switch r := req.(type) {
		case *kmsg.CreateACLsRequest:
			c := kmsg.NewCreateACLsRequestCreation()
			c.ResourceType, c.ResourceName, c.ResourcePatternType, c.Principal, c.Host, c.Operation, c.PermissionType =
				rt, a.ResourceName, pt, a.Principal, "*", op, kmsg.ACLPermissionTypeAllow
			r.Creations = append(r.Creations, c)
		case *kmsg.DeleteACLsRequest:
			f := kmsg.NewDeleteACLsRequestFilter()
			f.ResourceType, f.ResourceName, f.ResourcePatternType, f.Principal, f.Host, f.Operation, f.PermissionType =
				rt, &a.ResourceName, pt, &a.Principal, kmsg.StringPtr("*"), op, kmsg.ACLPermissionTypeAllow
			r.Filters = append(r.Filters, f)
		}
	}
	resp, err := kafkatest.Client(t, s.b.Broker, s.b.Opts(t)...).Request(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	switch r := resp.(type) {
	case *kmsg.CreateACLsResponse:
		for _, res := range r.Results {
			if err := kerr.ErrorForCode(res.ErrorCode); err != nil {
				t.Fatalf("create ACL: %v", err)
			}
		}
	case *kmsg.DeleteACLsResponse:
		for _, res := range r.Results {
			if err := kerr.ErrorForCode(res.ErrorCode); err != nil || len(res.MatchingACLs) != 1 {
				t.Fatalf("delete ACL: %v, %d deleted, want 1", err, len(res.MatchingACLs))
			}
		}
	}
}

// loseSlot creates the logical slot name and writes WAL past
// max_slot_wal_keep_size, switching segments and checkpointing until the
// server has removed the WAL the slot needed (wal_status lost), within 60 s.
func loseSlot(t *testing.T, url, name string) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", name); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE doctor_fill (x text)"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		var status string
		if err := conn.QueryRow(ctx, "SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1", name).Scan(&status); err != nil {
			t.Fatal(err)
		}
		if status == "lost" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("slot %s: wal_status %q after 60 s of WAL and checkpoints, want lost", name, status)
		}
		for _, q := range []string{"INSERT INTO doctor_fill SELECT repeat('x', 1000) FROM generate_series(1, 2000)",
			"SELECT pg_switch_wal()", "CHECKPOINT"} {
			if _, err := conn.Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// With the events on RabbitMQ, `km0 doctor` checks the topology the
// services declare (system.EventsTopology: the exchanges, every consumer's
// shard queues with their dead-letter arguments, the DLQs and their
// bindings to km0.dlx) through the management API: all ok once declared,
// and one failure naming the binding when a DLQ's binding is gone.
func TestDoctorChecksTheRabbitMQTopology(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	prefix := "doctor" + strings.ToLower(rand.Text()[:8]) + "."
	cfg := system.Config{Events: system.EventsRabbitMQ, EventsQueuePrefix: prefix}
	topo := doctor.Dedup(system.EventsTopology(cfg))
	conn, err := amqp.Dial(ctx, amqp.Config{URL: amqp.URLDefault, Name: "doctor test"})
	if err != nil {
		t.Fatalf("RabbitMQ at %s is required: %v", redact.URL(amqp.URLDefault), err)
	}
	t.Cleanup(func() {
		_ = conn.Do(ctx, func(ch *amqp091.Channel) error {
			for _, q := range topo.Queues {
				_, _ = ch.QueueDelete(q.Name, false, false, false)
			}
			for _, e := range topo.Exchanges {
				if strings.HasPrefix(e.Name, prefix) { // km0.dlx and the events exchange are shared
					_ = ch.ExchangeDelete(e.Name, false, false)
				}
			}
			return nil
		})
		conn.Close()
	})
	if err := conn.Declare(ctx, topo); err != nil {
		t.Fatal(err)
	}
	pg := pgtest.NewSchema(t)
	args := []string{"--database-url", pg.URL, "--events", "rabbitmq", "--events-queue-prefix", prefix, "--amqp-url", amqp.URLDefault}

	d := runDoctorJSON(t, nil, args...)
	if d.err != nil || len(d.failures()) > 0 {
		t.Fatalf("km0 doctor on a declared topology: %v\n%s\n%s", d.err, d.stdout, d.stderr)
	}
	want := fmt.Sprintf("%d exchanges, %d queues, %d bindings", len(topo.Exchanges), len(topo.Queues), len(topo.Bindings))
	found := false
	for _, f := range d.rows {
		found = found || f.Check == "rabbitmq topology" && strings.HasPrefix(f.Seen, want)
	}
	if !found {
		t.Fatalf("no ok row %q:\n%s", want, d.stdout)
	}

	dlq := prefix + pagaments.ConsumerCharge + ".dlq"
	key := prefix + pagaments.ConsumerCharge
	if err := conn.Do(ctx, func(ch *amqp091.Channel) error { return ch.QueueUnbind(dlq, key, amqp.DLXDefault, nil) }); err != nil {
		t.Fatal(err)
	}
	d = runDoctorJSON(t, nil, args...)
	d.only(t, map[string]string{"rabbitmq binding " + amqp.DLXDefault + " -> " + dlq: "missing binding with key " + key})
}
