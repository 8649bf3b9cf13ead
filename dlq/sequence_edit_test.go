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
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// order is a schema-valid comanda.creada of market mercat.
func order(t *testing.T, id, mercat string) []byte {
	t.Helper()
	e := &envelope.Envelope{ID: id, Type: "comanda.creada", Version: 1, TimeMS: time.Now().UnixMilli(), Origin: "comandes",
		Data: json.RawMessage(`{"id":"P-2026-7","client":"C-1","mercat":"` + mercat + `","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":250}]}`)}
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A head that can never succeed as it is (market "tancat" refused for good)
// blocks key P-2026-7 of a per-key order consumer, with two orders behind
// it. Replaying the sequence unchanged does not take, and the operator is
// told so: "did not take: dead-lettered again: <motiu>". Edit-and-replay of
// the head with a payload that breaks the schema, or changes its
// id_esdeveniment, is refused and sends nothing. A valid edit (market
// "olot") is applied, then the two orders behind it, in order; the key is
// released, no new letter appears, and the audit log holds the replay and
// the edit with who ran them; the letter keeps its original bytes.
func TestEditAndReplayClearsABlockedHeadInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if _, err := migrate.Up(b.ctx, b.schema.Pool, b.schema.Names(), keyorder.Migrations); err != nil {
		t.Fatal(err)
	}
	const name = "repartiment.assignacio"
	var mu sync.Mutex
	var applied []string
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: b.broker.Addrs(), Group: "repartiment", Topics: []string{comandes},
		KgoOpts: []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{Source: src, Pool: b.schema.Pool, Names: b.schema.Names(), Name: name,
		Inbox: inbox.New(inbox.Config{Names: b.schema.Names()}), Order: consumer.PerKey, Backoff: 20 * time.Millisecond,
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
	ctx, cancel := context.WithCancel(b.ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	head, b1, b2 := uuid.NewString(), uuid.NewString(), uuid.NewString()
	var msgs []*transport.Message
	for _, e := range []struct{ id, mercat string }{{head, "tancat"}, {b1, "girona"}, {b2, "girona"}} {
		msgs = append(msgs, &transport.Message{Topic: comandes, Key: []byte("P-2026-7"), Value: order(t, e.id, e.mercat),
			Headers: []transport.Header{{Key: "tipus", Value: "comanda.creada"}, {Key: "id_esdeveniment", Value: e.id}}})
	}
	if err := kafka.NewPublisher(b.client).Publish(b.ctx, msgs); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "the head and the two behind it dead-lettered and indexed", func() bool {
		b.sync(t)
		return b.rows(t, dlq.StatePending) == 3
	})

	ko, err := keyorder.New(keyorder.Config{Schema: b.schema.Name})
	if err != nil {
		t.Fatal(err)
	}
	seq, err := dlq.KeySequence(b.ctx, b.svc, ko, b.schema.Pool, name, "P-2026-7")
	if err != nil || len(seq.HeadLetters) != 1 || seq.Head.MessageID != head {
		t.Fatalf("sequence: %+v %v", seq, err)
	}
	var letter *string
	if err := b.schema.Pool.QueryRow(b.ctx, `SELECT id_carta FROM claus_bloquejades WHERE id_missatge = $1`, head).Scan(&letter); err != nil ||
		letter == nil || *letter != seq.HeadLetters[0].ID {
		t.Fatalf("claus_bloquejades.id_carta %v (%v), want the head's letter %s", letter, err, seq.HeadLetters[0].ID)
	}

	// Replayed unchanged, the head fails again: the operator is told.
	rep, err := dlq.ReplaySequence(b.ctx, b.svc, seq, dlq.ReplayOptions{Actor: "cli:maria"})
	if err != nil || rep.Done != 1 || len(rep.Items) != 3 {
		t.Fatalf("sequence replay: %+v %v", rep, err)
	}
	takes, err := b.svc.Watch(b.ctx, 20*time.Second, 0, rep)
	if err != nil || len(takes) != 1 || takes[0].Took ||
		takes[0].String() != "did not take: dead-lettered again: permanent: ciutat_no_coberta: tancat (letter "+takes[0].Again+")" {
		t.Fatalf("watch of a replay that failed again: %+v %v", takes, err)
	}
	seq, err = dlq.KeySequence(b.ctx, b.svc, ko, b.schema.Pool, name, "P-2026-7")
	if err != nil || len(seq.HeadLetters) != 1 || seq.HeadLetters[0].ID != takes[0].Again || len(seq.Behind) != 2 {
		t.Fatalf("sequence after the failed replay: %+v %v", seq, err)
	}
	records := b.records(t, comandesRetry)

	// Edits that are refused send nothing.
	bad := strings.Replace(string(order(t, head, "olot")), `"linies":[{`, `"linies":"x","l":[{`, 1)
	for what, v := range map[string][]byte{"breaks the schema": []byte(bad), "changes the id": order(t, uuid.NewString(), "olot"),
		"is not an envelope": []byte(`{"x":1}`)} {
		if _, err := dlq.EditSequence(b.ctx, b.svc, seq, v, dlq.EditOptions{Actor: "cli:maria"}); !errors.Is(err, dlq.ErrInvalidEdit) {
			t.Fatalf("an edit that %s: %v, want ErrInvalidEdit", what, err)
		}
	}
	if n := b.records(t, comandesRetry); n != records {
		t.Fatalf("refused edits published %d record(s)", n-records)
	}

	// A valid edit clears the key, in order.
	rep, err = dlq.EditSequence(b.ctx, b.svc, seq, order(t, head, "olot"), dlq.EditOptions{Actor: "console:joan"})
	if err != nil || rep.Done != 1 {
		t.Fatalf("edit and replay: %+v %v", rep, err)
	}
	testkit.Eventually(t, 30*time.Second, "the edited head and the two behind it applied", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(applied) >= 3
	})

	mu.Lock()
	got := strings.Join(applied, ",")
	mu.Unlock()
	if got != head+","+b1+","+b2 {
		t.Fatalf("applied %s, want the head then the two behind it in order", got)
	}
	takes, err = b.svc.Watch(b.ctx, time.Second, 0, rep)
	if err != nil || len(takes) != 1 || !takes[0].Took {
		t.Fatalf("watch of the edit: %+v %v", takes, err)
	}
	if _, err := dlq.KeySequence(b.ctx, b.svc, ko, b.schema.Pool, name, "P-2026-7"); !errors.Is(err, dlq.ErrNotBlocked) {
		t.Fatalf("the key after the edit: %v, want not blocked", err)
	}
	if l := b.get(t, seq.HeadLetters[0].ID); !strings.Contains(string(l.Value), `"tancat"`) || l.State != dlq.StateReplayed {
		t.Fatalf("the edited letter: state %s, value %s; want replayed with its original bytes", l.State, l.Value)
	}
	if edits, err := b.store.Edits(b.ctx, seq.HeadLetters[0].ID); err != nil || len(edits) != 1 || !strings.Contains(string(edits[0]), `"olot"`) {
		t.Fatalf("kept edits: %q %v", edits, err)
	}
	log, err := b.svc.AuditLog(b.ctx, dlq.AuditFilter{})
	if err != nil {
		t.Fatal(err)
	}
	var acts []string
	for _, e := range log {
		acts = append(acts, e.Actor+" "+e.Action+" "+strings.Join(e.Letters, "+")+" "+e.Result)
	}
	// Newest first: the edit and the purge of what it released, then the
	// replay that did not take and the purge of what it released.
	if len(log) != 4 || log[1].Actor != "console:joan" || log[1].Action != dlq.ActionEdit ||
		strings.Join(log[1].Letters, "+") != seq.HeadLetters[0].ID || log[0].Action != dlq.ActionPurge || len(log[0].Letters) != 2 ||
		log[3].Actor != "cli:maria" || log[3].Action != dlq.ActionReplay || len(log[3].Letters) != 1 ||
		log[2].Action != dlq.ActionPurge || len(log[2].Letters) != 2 || log[0].Result != "fet" {
		t.Fatalf("audit log, newest first:\n%s", strings.Join(acts, "\n"))
	}
	if st := c.Stats(); st.DeadLettered < 2 {
		t.Fatalf("consumer stats: %+v", st)
	}
	if res := b.sync(t); len(res.New) != 0 {
		t.Fatalf("%d new dead letter(s) after the edit, want 0", len(res.New))
	}
}
