package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// Poison in the key, not the payload: an id_esdeveniment PostgreSQL would
// refuse as an idempotency key (a NUL byte, 3 kB) goes to the DLQ at attempt 1
// and the healthy events around it on the same partition are processed.
func TestUnstorableEventIDIsDeadLetteredAndThePartitionMovesOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	bad := func(id string) *kgo.Record {
		v := fmt.Sprintf(`{"id_esdeveniment":%q,"tipus":"comanda.creada","versio":1,"dades":{"id":"P-1","linies":[]}}`, id)
		return &kgo.Record{Topic: topic, Key: []byte("P-1"), Value: []byte(v), Partition: 0,
			Headers: []kgo.RecordHeader{{Key: "tipus", Value: []byte("comanda.creada")}}}
	}
	var recs []*kgo.Record
	for i := range 10 {
		recs = append(recs, newEvent("P-1", comanda{ID: "P-1", N: i}).record())
	}
	recs = append(recs[:5], append([]*kgo.Record{bad("nul\x00id"), bad(strings.Repeat("x", 3000))}, recs[5:]...)...)
	b.publish(recs...)
	st := b.runUntil(b.config(effect), "10 processed, 2 dead-lettered", func(s consumer.Stats) bool {
		return s.Processed == 10 && s.DeadLettered == 2
	})
	if st.Retried != 0 || b.effects() != 10 {
		t.Fatalf("retried %d (want 0), effects %d (want 10)", st.Retried, b.effects())
	}
}

// The transaction's BEGIN travels with the keys' INSERT in one round trip
// (pgx.Batch.BeginTx), also on a pool in the simple protocol (what a
// PgBouncer in transaction mode needs): keys are recorded, a redelivered id
// is absorbed as a duplicate, unstorable keys are dead-lettered, and no
// BEGIN is sent alone (tracer: a standalone "begin" statement fails it).
func TestBeginTravelsWithTheKeysAlsoInTheSimpleProtocol(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pcfg := b.s.Pool.Config().Copy()
	pcfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	tr := &beginCounter{}
	pcfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var recs []*kgo.Record
	for i := range 8 {
		recs = append(recs, newEvent(fmt.Sprintf("P-%d", i%3), comanda{ID: "P-1", N: i}).record())
	}
	recs = append(recs, recs[2], recs[6]) // redelivered: the same ids again
	v := `{"id_esdeveniment":"nul\u0000id","tipus":"comanda.creada","versio":1,"dades":{"id":"P-1","linies":[]}}`
	recs = append(recs, &kgo.Record{Topic: topic, Key: []byte("P-1"), Value: []byte(v),
		Headers: []kgo.RecordHeader{{Key: "tipus", Value: []byte("comanda.creada")}}})
	// A key PostgreSQL refuses as data (invalid UTF-8, from a decoder of
	// the application's): in the simple protocol the server refuses the
	// whole batch, BEGIN included, and it must still reach the DLQ at its
	// first attempt, not be retried as an outage.
	badUTF8 := newEvent("P-2", comanda{ID: "P-2", N: 99})
	recs = append(recs, badUTF8.record())
	b.publish(recs...)
	cfg := b.config(effect)
	cfg.Pool = pool
	cfg.Decode = func(v []byte) (*envelope.Envelope, error) {
		e, err := envelope.Decoder{}.Decode(v)
		if err == nil && e.ID == badUTF8.id {
			e.ID += "\xff"
		}
		return e, err
	}
	st := b.runUntil(cfg, "8 processed, 2 duplicates, 2 dead-lettered", func(s consumer.Stats) bool {
		return s.Processed == 8 && s.Duplicates == 2 && s.DeadLettered == 2
	})
	if st.Retried != 0 || b.effects() != 8 {
		t.Fatalf("retried %d (want 0), effects %d (want 8)", st.Retried, b.effects())
	}
	if n := b.count(`SELECT count(*) FROM `+pgx.Identifier{b.s.Name, b.s.Names().Processats}.Sanitize()+` WHERE consumidor = $1`, name); n != 8 {
		t.Fatalf("%d keys recorded, want 8", n)
	}
	if n := tr.alone.Load(); n != 0 {
		t.Fatalf("%d BEGINs sent on their own, want 0: each goes with the keys' INSERT", n)
	}
}

// beginCounter counts BEGIN statements sent on their own (Conn.Begin), not
// as the first query of a batch.
type beginCounter struct{ alone atomic.Int64 }

func (c *beginCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.EqualFold(strings.TrimSpace(d.SQL), "begin") {
		c.alone.Add(1)
	}
	return ctx
}

func (c *beginCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A handler that swallows a failed statement returns nil on an aborted
// transaction; COMMIT then rolls back. The message fails on its own (retry,
// then DLQ) and its neighbours in the batch are processed.
func TestHandlerSwallowingASQLErrorDoesNotStallItsNeighbours(t *testing.T) {
	t.Parallel()
	b := setup(t)
	poisonID := uuid.NewString()
	var recs []*kgo.Record
	for i := range 6 {
		e := newEvent("P-1", comanda{ID: "P-1", N: i})
		if i == 3 {
			e.id = poisonID
		}
		recs = append(recs, e.record())
	}
	b.publish(recs...)
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Envelope.ID == poisonID {
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // the bug: error ignored, transaction aborted
			return nil
		}
		return effect(ctx, tx, m)
	})
	cfg.MaxAttempts = 1
	st := b.runUntil(cfg, "5 processed, 1 dead-lettered", func(s consumer.Stats) bool {
		return s.Processed == 5 && s.DeadLettered == 1
	})
	if b.effects() != 5 {
		t.Fatalf("effects %d, want 5 (stats %+v)", b.effects(), st)
	}
}

// Failure point: a record near the broker's size limit fails transiently; its
// retry copy (the original plus our headers) is refused for good. The loss is
// not silent: a header-only dead letter points at the original, and the
// attempt is counted as dead-lettered, not as retried.
func TestCopyTooLargeForTheBrokerBecomesAHeaderOnlyDeadLetter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pad := strings.Repeat("x", 1<<20-400)
	id := uuid.NewString()
	v := fmt.Sprintf(`{"id_esdeveniment":%q,"tipus":"comanda.creada","versio":1,"dades":{"id":"P-1","linies":[],"p":%q}}`, id, pad)
	b.publish(&kgo.Record{Topic: topic, Key: []byte("P-1"), Value: []byte(v),
		Headers: []kgo.RecordHeader{{Key: "tipus", Value: []byte("comanda.creada")}, {Key: "id_esdeveniment", Value: []byte(id)}}})
	cfg := b.config(func(context.Context, pgx.Tx, *consumer.Message) error {
		return outcome.Transient(errors.New("maps 503"))
	})
	// The original went in compressed; the copy goes uncompressed, so it is over the limit.
	cfg.KgoOpts = append(cfg.KgoOpts, kgo.ProducerBatchCompression(kgo.NoCompression()), kgo.ProducerBatchMaxBytes(2<<20), kgo.FetchMaxBytes(4<<20), kgo.FetchMaxPartitionBytes(4<<20))
	st := b.runUntil(cfg, "the attempt dead-lettered", func(s consumer.Stats) bool { return s.DeadLettered == 1 })
	if st.Retried != 0 {
		t.Fatalf("retried %d: the refused copy was counted as a retry", st.Retried)
	}
	recs := b.read(topic+contract.DLQSuffix, 1)
	if len(recs[0].Value) != 0 || !strings.HasPrefix(hdr(recs[0], "motiu"), "permanent: massa_gran: copy refused by the broker (") ||
		hdr(recs[0], contract.HeaderOriginalOffset) != "0" || hdr(recs[0], "id_esdeveniment") != id {
		t.Fatalf("dead letter: %d bytes, headers %v", len(recs[0].Value), recs[0].Headers)
	}
}

// Failure point: a malformed record whose bulk is in a header (the topic
// took it compressed) is dead-lettered at attempt 1; its DLQ copy and then
// the header-only stub keeping that header are both refused for good. The
// poison must still leave the partition: a stub without the oversized header
// goes to the DLQ, and the healthy record behind it is processed and both
// offsets are committed.
func TestOversizedHeaderNeverBlocksThePartition(t *testing.T) {
	t.Parallel()
	b := setup(t)
	big := strings.Repeat("x", 1<<20-250)
	b.publish(&kgo.Record{Topic: topic, Key: []byte("P-1"), Value: []byte("{not json"),
		Headers: []kgo.RecordHeader{{Key: "tipus", Value: []byte("comanda.creada")}, {Key: "traca", Value: []byte(big)}}})
	b.publishEvents(newEvent("P-1", comanda{ID: "P-1", N: 1}))
	cfg := b.config(effect)
	cfg.KgoOpts = append(cfg.KgoOpts, kgo.ProducerBatchCompression(kgo.NoCompression()), kgo.ProducerBatchMaxBytes(2<<20), kgo.FetchMaxBytes(4<<20), kgo.FetchMaxPartitionBytes(4<<20))
	st := b.runUntil(cfg, "1 dead-lettered, 1 processed", func(s consumer.Stats) bool {
		return s.DeadLettered == 1 && s.Processed == 1
	})
	if b.effects() != 1 || b.committed(topic) != 2 {
		t.Fatalf("effects %d (want 1), committed %d (want 2), stats %+v", b.effects(), b.committed(topic), st)
	}
	recs := b.read(topic+contract.DLQSuffix, 1)
	if len(recs) != 1 || !strings.HasPrefix(hdr(recs[0], "motiu"), "permanent: massa_gran") ||
		hdr(recs[0], contract.HeaderOriginalOffset) != "0" || hdr(recs[0], "traca") != "" {
		t.Fatalf("dead letters: %d, first with motiu %q and %d header bytes", len(recs), hdr(recs[0], "motiu"), len(hdr(recs[0], "traca")))
	}
}

// Kafka refuses a whole batch over message.max.bytes. Ten dead-letter copies
// of ~3 kB produced together under a 10 kB limit made one refused batch, and
// each copy became a header-only stub: its body was lost although it fit on
// its own. Each is now sent again alone first and keeps its body.
func TestCopiesThatFitAloneKeepTheirBodiesUnderASmallLimit(t *testing.T) {
	t.Parallel()
	b := setupWith(t, kafkaembed.Config{MaxMessageBytes: 10_000})
	const n = 10
	values := map[string]bool{}
	for i := range n { // one at a time: each fits the limit
		v := fmt.Sprintf(`{"no es json %d %s`, i, strings.Repeat("x", 3_000))
		values[v] = true
		b.publish(&kgo.Record{Topic: topic, Key: []byte("P-1"), Value: []byte(v),
			Headers: []kgo.RecordHeader{{Key: "tipus", Value: []byte("comanda.creada")}}})
	}
	cfg := b.config(effect)
	cfg.BatchSize = n
	cfg.KgoOpts = append(cfg.KgoOpts, kgo.ProducerBatchCompression(kgo.NoCompression())) // 'x' * 3,000 would compress into one small batch
	st := b.runUntil(cfg, "10 dead-lettered", func(s consumer.Stats) bool { return s.DeadLettered == n })
	recs := b.read(topic+contract.DLQSuffix, n)
	kept := 0
	for _, r := range recs {
		if values[string(r.Value)] && strings.HasPrefix(hdr(r, "motiu"), "permanent: envelope") {
			kept++
		}
	}
	if len(recs) != n || kept != n {
		t.Fatalf("%d dead letters, %d with their original body and motiu; want %d and %d (stats %+v)", len(recs), kept, n, n, st)
	}
}
