package dlq_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/amqpdlq"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

// skipCase is one broker's set-up for checkSkip: a consumer in per-key order
// running on src, a Service over its DLQ, a publisher to its topic.
type skipCase struct {
	ctx   context.Context
	db    *pgtest.Schema
	svc   *dlq.Service
	src   transport.Source
	pub   transport.Publisher
	topic string
}

// checkSkip: a poisoned head (refused for good: market "tancat") and three
// orders behind it on key P-2026-9 are dead-lettered by a per-key order
// consumer. Skipping the head, with a reason, applies the three in order and
// never the head; the key is no longer blocked, the head's letter is purged,
// the audit log has one skip entry (who, the head's letter, the reason) and
// no new letter appears.
func checkSkip(t *testing.T, k skipCase) {
	ctx := k.ctx
	if _, err := migrate.Up(ctx, k.db.Pool, k.db.Names(), keyorder.Migrations); err != nil {
		t.Fatal(err)
	}
	const name, key = "repartiment.assignacio", "P-2026-9"
	var mu sync.Mutex
	var applied []string
	c, err := consumer.New(consumer.Config{Source: k.src, Pool: k.db.Pool, Names: k.db.Names(), Name: name,
		Inbox: inbox.New(inbox.Config{Names: k.db.Names()}), Order: consumer.PerKey, Backoff: 20 * time.Millisecond,
		Handle: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			var d struct{ Mercat string }
			_ = json.Unmarshal(m.Envelope.Data, &d)
			if d.Mercat == "tancat" {
				return outcome.Permanentf("ciutat_no_coberta: %s", d.Mercat)
			}
			mu.Lock()
			applied = append(applied, m.Envelope.ID)
			mu.Unlock()
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })

	head := uuid.NewString()
	behind := []string{uuid.NewString(), uuid.NewString(), uuid.NewString()}
	for i, id := range append([]string{head}, behind...) {
		mercat := "girona"
		if i == 0 {
			mercat = "tancat"
		}
		m := &transport.Message{Topic: k.topic, Key: []byte(key), Value: order(t, id, mercat),
			Headers: []transport.Header{{Key: "tipus", Value: "comanda.creada"}, {Key: "id_esdeveniment", Value: id}}}
		if err := k.pub.Publish(ctx, []*transport.Message{m}); err != nil { // one by one: in order on every broker
			t.Fatal(err)
		}
	}
	pending := func() int {
		var n int
		if err := k.db.Pool.QueryRow(ctx, `SELECT count(*) FROM cartes_mortes WHERE estat = 'pendent'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 30*time.Second, "the head and the three behind it dead-lettered and indexed", func() bool {
		if _, err := k.svc.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		return pending() == 4
	})

	ko, err := keyorder.New(keyorder.Config{Schema: k.db.Name})
	if err != nil {
		t.Fatal(err)
	}
	seq, err := dlq.KeySequence(ctx, k.svc, ko, k.db.Pool, name, key)
	if err != nil || seq.Head.MessageID != head || len(seq.HeadLetters) != 1 || len(seq.Behind) != 3 {
		t.Fatalf("sequence: %+v %v", seq, err)
	}
	if _, err := dlq.SkipSequence(ctx, k.svc, ko, k.db.Pool, seq, dlq.SkipOptions{Actor: "cli:maria"}); !errors.Is(err, dlq.ErrSkipRefused) {
		t.Fatalf("skip without a reason: %v, want ErrSkipRefused", err)
	}
	const why = "v1 order for a market that is closed for good"
	rep, err := dlq.SkipSequence(ctx, k.svc, ko, k.db.Pool, seq, dlq.SkipOptions{Actor: "console:joan", Reason: why})
	if err != nil || rep.Skipped.Done != 1 || rep.Next != behind[0] || rep.Replay == nil || rep.Replay.Done != 1 || len(rep.Replay.Items) != 3 {
		t.Fatalf("skip: %+v %v", rep, err)
	}
	testkit.Eventually(t, 30*time.Second, "the three behind the head applied", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(applied) >= 3
	})

	takes, err := k.svc.Watch(ctx, time.Second, 0, rep.Replay)
	if err != nil || len(takes) != 1 || !takes[0].Took {
		t.Fatalf("watch of the skip's replay: %+v %v", takes, err)
	}
	mu.Lock()
	got := strings.Join(applied, ",")
	mu.Unlock()
	if got != strings.Join(behind, ",") {
		t.Fatalf("applied %s, want the three behind the head in order, and not the head", got)
	}
	if _, err := dlq.KeySequence(ctx, k.svc, ko, k.db.Pool, name, key); !errors.Is(err, dlq.ErrNotBlocked) {
		t.Fatalf("the key after the skip: %v, want not blocked", err)
	}
	if l, err := k.svc.Get(ctx, seq.HeadLetters[0].ID); err != nil || l.State != dlq.StatePurged {
		t.Fatalf("the skipped head's letter: %+v %v, want purged", l, err)
	}
	log, err := k.svc.AuditLog(ctx, dlq.AuditFilter{})
	if err != nil {
		t.Fatal(err)
	}
	var skips []dlq.AuditEntry
	for _, e := range log {
		if e.Action == dlq.ActionSkip {
			skips = append(skips, e)
		}
	}
	if len(skips) != 1 || skips[0].Actor != "console:joan" || strings.Join(skips[0].Letters, ",") != seq.HeadLetters[0].ID ||
		!strings.Contains(skips[0].Result, why) {
		t.Fatalf("audit log skip entries: %+v, want one by console:joan on %s with the reason", skips, seq.HeadLetters[0].ID)
	}
	if res, err := k.svc.Sync(ctx); err != nil || len(res.New) != 0 || pending() != 0 {
		t.Fatalf("after the skip: %d new letter(s), %d pending, %v; want 0, 0", len(res.New), pending(), err)
	}
}

func TestSkipReleasesTheSequenceBehindAPoisonedHeadOnKafka(t *testing.T) {
	t.Parallel()
	b := setup(t)
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: b.broker.Addrs(), Group: "repartiment", Topics: []string{comandes},
		KgoOpts: []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)}})
	if err != nil {
		t.Fatal(err)
	}
	checkSkip(t, skipCase{ctx: b.ctx, db: b.schema, svc: b.svc, src: src, pub: kafka.NewPublisher(b.client), topic: comandes})
}

func TestSkipReleasesTheSequenceBehindAPoisonedHeadOnRabbitMQ(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := amqptest.Dial(t)
	db := pgtest.NewSchema(t)
	if _, err := migrate.Up(ctx, db.Pool, db.Names(), dlq.Migrations, migrate.Inbox); err != nil {
		t.Fatal(err)
	}
	exchange := amqptest.Name("t.esdeveniments")
	amqptest.DeleteExchangesAtCleanup(t, exchange)
	queue := amqptest.Name("t.repartiment")
	src, err := amqp.NewSource(ctx, amqp.SourceConfig{Conn: conn, Queue: queue, Exchange: exchange, RoutingKeys: []string{comandes}, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	amqptest.DeleteQueuesAtCleanup(t, src.Queues)
	pub, err := amqp.NewPublisher(ctx, conn, amqp.PublisherConfig{Exchange: exchange})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	backend, err := amqpdlq.New(amqpdlq.Config{Conn: conn, Queues: []string{queue}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = backend.Close() })
	svc, err := dlq.NewService(dlq.ServiceConfig{Store: dlq.NewStore(db.Pool, db.Name), Backend: backend})
	if err != nil {
		t.Fatal(err)
	}
	checkSkip(t, skipCase{ctx: ctx, db: db, svc: svc, src: src, pub: pub, topic: comandes})
}
