package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

// rabbitDLQ is a running RabbitMQ consumer (with an inbox) whose handler
// fails until fixed, and the flags `km0 dlq` needs to operate its DLQ.
type rabbitDLQ struct {
	t     *testing.T
	conn  *amqp.Conn
	db    *pgtest.Schema
	queue string
	cons  *consumer.Consumer
	fixed atomic.Bool
	base  []string
}

func newRabbitDLQ(t *testing.T) *rabbitDLQ {
	ctx := context.Background()
	r := &rabbitDLQ{t: t, conn: amqptest.Dial(t), db: pgtest.NewMigratedSchema(t), queue: amqptest.Name("t.km0dlq")}
	if _, err := r.db.Pool.Exec(ctx, `CREATE TABLE efectes (n BIGSERIAL PRIMARY KEY, id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Up(ctx, r.db.Pool, r.db.Names(), dlq.Migrations); err != nil { // so indexed() can count 0
		t.Fatal(err)
	}
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		switch {
		case string(m.Key) == "perm" && !r.fixed.Load():
			return outcome.Permanentf("esquema: falta adreca_lliurament")
		case string(m.Key) == "trans" && !r.fixed.Load():
			return errors.New("mapes: 503")
		}
		_, err := tx.Exec(ctx, `INSERT INTO efectes (id) VALUES ($1)`, m.Envelope.ID)
		return err
	}
	src, err := amqp.NewSource(ctx, amqp.SourceConfig{Conn: r.conn, Queue: r.queue, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	amqptest.DeleteQueuesAtCleanup(t, src.Queues)
	c, err := consumer.New(consumer.Config{Source: src, Pool: r.db.Pool,
		Name: "prova.efecte", Inbox: inbox.New(inbox.Config{Names: r.db.Names()}), Handle: handler,
		MaxAttempts: 2, Backoff: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	r.cons = c
	r.base = []string{"--amqp-url", amqptest.URL(), "--queue", r.queue, "--database-url", r.db.URL, "--schema", r.db.Name}
	return r
}

func (r *rabbitDLQ) publish(key string) string {
	r.t.Helper()
	e := &envelope.Envelope{ID: uuid.NewString(), Type: "comanda.creada", Version: 1, TimeMS: time.Now().UnixMilli(),
		Origin: "comandes", Data: json.RawMessage(`{"id":"P-1"}`)}
	b, err := e.Encode()
	if err != nil {
		r.t.Fatal(err)
	}
	pub, err := amqp.NewPublisher(context.Background(), r.conn, amqp.PublisherConfig{})
	if err != nil {
		r.t.Fatal(err)
	}
	defer pub.Close() //nolint:errcheck
	m := &transport.Message{Topic: r.queue, Key: []byte(key), Value: b, Headers: []transport.Header{
		{Key: contract.HeaderType, Value: e.Type}, {Key: contract.HeaderEventID, Value: e.ID}}}
	if err := pub.Publish(context.Background(), []*transport.Message{m}); err != nil {
		r.t.Fatal(err)
	}
	return e.ID
}

func (r *rabbitDLQ) run(args ...string) (string, error) {
	var out, errOut bytes.Buffer
	c := &dlqcli.CLI{Out: &out, ErrOut: &errOut, In: strings.NewReader(""), Now: time.Now}
	err := c.Run(context.Background(), append(append([]string{args[0]}, r.base...), args[1:]...))
	return out.String() + errOut.String(), err
}

// onBroker and indexed count the letters in <queue>.dlq and in the index.
func (r *rabbitDLQ) onBroker() int {
	r.t.Helper()
	return amqptest.DLQLen(r.t, r.conn, r.queue)
}

func (r *rabbitDLQ) indexed() int {
	r.t.Helper()
	var n int
	if err := r.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM cartes_mortes`).Scan(&n); err != nil {
		r.t.Fatal(err)
	}
	return n
}

func (r *rabbitDLQ) effects(id string) (all, forID int) {
	r.t.Helper()
	if err := r.db.Pool.QueryRow(context.Background(), `SELECT count(*), count(*) FILTER (WHERE id = $1) FROM efectes`, id).
		Scan(&all, &forID); err != nil {
		r.t.Fatal(err)
	}
	return all, forID
}

// `km0 dlq` on a RabbitMQ DLQ: a permanent failure (native nack) and an
// exhausted transient (motiu) land in <queue>.dlq; ls moves them into the
// index (broker 2 + index 0 → broker 0 + index 2; a second ls changes
// neither) and groups them by motiu; show prints headers and envelope;
// replay sends both back with their id_esdeveniment and, once the handler is
// fixed, each effect is applied; a forced second replay is a duplicate for
// the inbox and the effect count stays 1; purge needs a confirmation.
func TestDLQCommandsOnRabbitMQ(t *testing.T) {
	t.Parallel()
	r := newRabbitDLQ(t)
	perm, trans := r.publish("perm"), r.publish("trans")
	testkit.Eventually(t, 20*time.Second, "2 dead letters in the DLQ", func() bool { return r.onBroker() == 2 })
	if n := r.indexed(); n != 0 {
		t.Fatalf("index holds %d letters before any km0 dlq command", n)
	}

	out, err := r.run("ls")
	if err != nil || !strings.Contains(out, "2 new dead letter(s) indexed") || !strings.Contains(out, "2 dead letter(s)") ||
		!strings.Contains(out, "permanent: rejected by "+r.queue) || !strings.Contains(out, "transitori esgotat: mapes") {
		t.Fatalf("ls: %v\n%s", err, out)
	}
	if b, i := r.onBroker(), r.indexed(); b != 0 || i != 2 {
		t.Fatalf("after the first sync: %d on the broker, %d indexed; want 0 and 2", b, i)
	}
	out, err = r.run("ls", "--json")
	var ls struct {
		Groups  []dlq.Group      `json:"grups"`
		Letters []dlq.LetterView `json:"cartes"`
	}
	if err != nil || json.Unmarshal([]byte(out), &ls) != nil || len(ls.Groups) != 2 || len(ls.Letters) != 2 {
		t.Fatalf("second ls --json: %v\n%s", err, out)
	}
	if b, i := r.onBroker(), r.indexed(); b != 0 || i != 2 {
		t.Fatalf("after the second sync: %d on the broker, %d indexed; want 0 and 2", b, i)
	}
	ids := map[string]string{} // id_esdeveniment → letter ID
	for _, l := range ls.Letters {
		ids[l.EventID] = l.ID
		if l.Topic != contract.DLQName(r.queue) || l.OriginalTopic != r.queue {
			t.Fatalf("letter %+v: want DLQ %s, origin %s", l, contract.DLQName(r.queue), r.queue)
		}
	}
	if ids[perm] == "" || ids[trans] == "" {
		t.Fatalf("letters %v lack an event (%s, %s)", ids, perm, trans)
	}

	out, err = r.run("show", ids[perm])
	if err != nil || !strings.Contains(out, "headers:") || !strings.Contains(out, "x-death: rejected in "+r.queue) ||
		!strings.Contains(out, "envelope:") || !strings.Contains(out, `"id_esdeveniment": "`+perm+`"`) {
		t.Fatalf("show: %v\n%s", err, out)
	}

	r.fixed.Store(true)
	out, err = r.run("replay", "--all")
	if err != nil || !strings.Contains(out, "2 selected, 2 replayed, 0 refused") {
		t.Fatalf("replay: %v\n%s", err, out)
	}
	testkit.Eventually(t, 20*time.Second, "2 effects after the replay", func() bool { n, _ := r.effects(""); return n == 2 })
	for _, id := range []string{perm, trans} {
		if _, n := r.effects(id); n != 1 {
			t.Fatalf("event %s applied %d times, want 1 (same id_esdeveniment)", id, n)
		}
	}

	dup := r.cons.Stats().Duplicates
	if out, err := r.run("replay", "--id", ids[trans], "--force"); err != nil || !strings.Contains(out, "1 replayed") {
		t.Fatalf("forced replay: %v\n%s", err, out)
	}
	testkit.Eventually(t, 20*time.Second, "the inbox to report the duplicate", func() bool { return r.cons.Stats().Duplicates == dup+1 })
	if all, n := r.effects(trans); all != 2 || n != 1 {
		t.Fatalf("after replaying an applied event: %d effects, %d for it; want 2 and 1", all, n)
	}

	if _, err := r.run("purge", "--all"); err == nil || !strings.Contains(err.Error(), "--yes") {
		t.Fatalf("purge without confirmation: %v", err)
	}
	if out, err := r.run("purge", "--all", "--yes"); err != nil || !strings.Contains(out, "2 letter(s) marked purged") ||
		!strings.Contains(out, "left the broker") {
		t.Fatalf("purge --yes: %v\n%s", err, out)
	}
	if out, err := r.run("ls"); err != nil || !strings.Contains(out, "0 dead letter(s) (state pending)") {
		t.Fatalf("ls after purge: %v\n%s", err, out)
	}
	if b, i := r.onBroker(), r.indexed(); b != 0 || i != 2 {
		t.Fatalf("at the end: %d on the broker, %d indexed; want 0 and 2", b, i)
	}
}

// --amqp-url alone is not enough, and --help never prints $KM0_AMQP_URL.
//
// Not parallel: t.Setenv, for the environment km0 dlq ($KM0_AMQP_URL) reads
// in this process.
func TestDLQRabbitMQFlags(t *testing.T) {
	t.Setenv("KM0_AMQP_URL", "amqp://u:s3cr3t@127.0.0.1:5672/")
	var out, errOut bytes.Buffer
	c := &dlqcli.CLI{Out: &out, ErrOut: &errOut, In: strings.NewReader(""), Now: time.Now}
	err := c.Run(context.Background(), []string{"ls", "--amqp-url", "amqp://127.0.0.1:5672/", "--database-url", "postgres://x"})
	if err == nil || !strings.Contains(err.Error(), "--queue") {
		t.Fatalf("--amqp-url without --queue: %v", err)
	}
	_ = c.Run(context.Background(), []string{"ls", "--help"})
	if s := out.String() + errOut.String(); strings.Contains(s, "s3cr3t") || !strings.Contains(s, "-queue") {
		t.Fatalf("--help leaks the password or lacks --queue:\n%s", s)
	}
}

// `km0 dlq ls` over amqps:// (--amqp-tls-ca-file, through a TLS listener in
// front of the broker) takes the DLQ's letter into the index: broker 1 +
// index 0 → broker 0 + index 1.
func TestDLQCommandsOverTLS(t *testing.T) {
	t.Parallel()
	r := newRabbitDLQ(t)
	r.publish("perm")
	testkit.Eventually(t, 20*time.Second, "1 dead letter in the DLQ", func() bool { return r.onBroker() == 1 })
	b := amqptest.NewTLSBroker(t, false)
	out, err := r.run("ls", "--amqp-url", b.URL, "--amqp-tls-ca-file", b.CA.CertFile, "--amqp-tls-server-name", b.ServerName)
	if err != nil || !strings.Contains(out, "1 new dead letter(s) indexed") {
		t.Fatalf("ls over TLS: %v\n%s", err, out)
	}
	if bk, i := r.onBroker(), r.indexed(); bk != 0 || i != 1 || b.Proxy.Accepted() == 0 {
		t.Fatalf("after ls over TLS: %d on the broker, %d indexed, %d TLS connections; want 0, 1 and some", bk, i, b.Proxy.Accepted())
	}
}
