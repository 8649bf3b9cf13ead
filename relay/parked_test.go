package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// big is a payload of about n bytes.
func big(seq, n int) map[string]any {
	return map[string]any{"seq": seq, "farciment": strings.Repeat("x", n)}
}

// A row over MaxRecordBytes is parked unsent with its reason; the other
// aggregates keep flowing; the later rows of its aggregate wait behind it;
// the operator sees it (Parked, metric) and releases it, and then the
// aggregate goes out in commit order.
func TestOversizedRowIsParkedAndItsAggregateWaits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	cfg := b.config()
	cfg.MaxRecordBytes, cfg.Metrics = 2000, reg
	r := b.newRelay(t, cfg)

	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 1})
	x2 := b.enqueue(t, "X", big(2, 3000))
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 3})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 1})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 2})
	if n := b.drainOnce(t, r); n != 3 {
		t.Fatalf("published %d, want 3 (X1, Y1, Y2)", n)
	}
	parked, err := relay.Parked(ctx, b.s.Pool, b.s.Names())
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].ID != x2 || parked[0].AggregateID != "X" || parked[0].Type != "comanda.creada" ||
		!strings.Contains(parked[0].Reason, "over the relay's limit of 2000") || parked[0].Waiting != 1 {
		t.Fatalf("parked: %+v", parked)
	}
	if v := metricValue(t, reg, relay.MetricParked); v != 1 {
		t.Fatalf("%s = %v, want 1", relay.MetricParked, v)
	}
	if v := metricValue(t, reg, relay.MetricPending); v != 2 {
		t.Fatalf("%s = %v, want 2 (X2 parked, X3 waiting)", relay.MetricPending, v)
	}

	// Later events: Y flows, X waits.
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 4})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 3})
	if n := b.drainOnce(t, r); n != 1 {
		t.Fatalf("published %d, want 1 (Y3)", n)
	}
	if p := b.pending(t); p != 3 {
		t.Fatalf("%d pending, want 3 (X2 parked, X3 and X4 waiting)", p)
	}

	if err := relay.Release(ctx, b.s.Pool, b.s.Names(), uuid.New()); !errors.Is(err, relay.ErrNotParked) {
		t.Fatalf("releasing an unknown id: %v", err)
	}
	if err := relay.Release(ctx, b.s.Pool, b.s.Names(), x2); err != nil {
		t.Fatal(err)
	}
	// The operator raised the limit (to the default) and restarted the relay.
	r.Close()
	if n := b.drainOnce(t, b.newRelay(t, b.config())); n != 3 {
		t.Fatalf("after release published %d, want 3", n)
	}
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, 7))
	if len(copies) != 7 {
		t.Fatalf("%d events on the topic, want 7", len(copies))
	}
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"X": 4, "Y": 3})
	if v := metricValue(t, reg, relay.MetricPublished); v != 4 {
		t.Fatalf("%s = %v, want 4", relay.MetricPublished, v)
	}
}

// The broker (here the producer's own batch limit, MESSAGE_TOO_LARGE) refuses
// a record for good after it was sent: the row is parked with the broker's
// reason, the other records of the batch are confirmed and marked, and the
// later row of its aggregate, in a later chunk of the same batch, is held
// back unsent.
func TestRowRefusedByTheBrokerIsParked(t *testing.T) {
	t.Parallel()
	b := setupWith(t, kafkaembed.Config{Topics: []string{topic}}, kgo.ProducerBatchMaxBytes(5000))
	ctx := context.Background()
	cfg := b.config()
	cfg.BatchSize = 400 // chunks of 100 rows
	r := b.newRelay(t, cfg)
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 1})
	x2 := b.enqueue(t, "X", big(2, 8000))
	ys := make([]*outbox.Event, 150)
	for i := range ys {
		ys[i] = &outbox.Event{Aggregate: "comanda", AggregateID: "Y", Type: "comanda.creada", Payload: relaytest.SeqPayload{Seq: i + 1}}
	}
	if err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error { return b.ob.EnqueueBatch(ctx, tx, ys) }); err != nil {
		t.Fatal(err)
	}
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 3}) // row 153: second chunk
	if n := b.drainOnce(t, r); n != 151 {
		t.Fatalf("published %d, want 151 (X1 and Y1..Y150)", n)
	}
	if p := b.pending(t); p != 2 {
		t.Fatalf("%d pending, want 2 (X2 parked, X3 held behind it)", p)
	}
	parked, err := relay.Parked(ctx, b.s.Pool, b.s.Names())
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].ID != x2 || !strings.Contains(parked[0].Reason, "MESSAGE_TOO_LARGE") {
		t.Fatalf("parked: %+v", parked)
	}
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 4})
	if n := b.drainOnce(t, r); n != 0 {
		t.Fatalf("published %d while X2 is parked, want 0", n)
	}
	// The operator fixes the producer, restarts the relay and releases X2.
	r.Close()
	if n, err := relay.ReleaseAll(ctx, b.s.Pool, b.s.Names()); err != nil || n != 1 {
		t.Fatalf("release all: %d, %v", n, err)
	}
	cfg = b.config()
	cfg.Publisher = kafka.NewPublisher(kafkatest.Client(t, b.b))
	if n := b.drainOnce(t, b.newRelay(t, cfg)); n != 3 {
		t.Fatalf("with a producer that accepts it published %d, want 3", n)
	}
	perKey, _ := relaytest.FirstSeqs(t, b.read(t, 154))
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"X": 4, "Y": 150})
}

// A reason longer than the parking limit is cut on a character boundary: a
// Transform error in Catalan whose "à" straddles the cut is still parked, and
// so is one with a NUL byte or invalid UTF-8, and the rest of the batch goes out (a cut inside the character made the parking
// INSERT fail as invalid UTF-8, and the whole batch was retried for ever).
func TestLongNonASCIIReasonIsParked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	cfg := b.config()
	cfg.Transform = func(row *outbox.Row, env *envelope.Envelope) ([]*envelope.Envelope, error) {
		if row.AggregateID == "X" {
			// "transform: " is 11 bytes: the first "à" takes bytes 499 and 500.
			return nil, errors.New(strings.Repeat("x", 488) + "àà dades no vàlides")
		}
		if row.AggregateID == "Z" {
			return nil, errors.New("raw bytes \x00\xff in the payload") // NUL and invalid UTF-8
		}
		return []*envelope.Envelope{env}, nil
	}
	r := b.newRelay(t, cfg)
	x1 := b.enqueue(t, "X", relaytest.SeqPayload{Seq: 1})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 1})
	z1 := b.enqueue(t, "Z", relaytest.SeqPayload{Seq: 1})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 2})
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatalf("run once: %v", err)
	}
	if n != 2 {
		t.Fatalf("published %d, want 2 (Y1, Y2)", n)
	}
	parked, err := relay.Parked(ctx, b.s.Pool, b.s.Names())
	if err != nil {
		t.Fatal(err)
	}
	reasons := map[uuid.UUID]string{}
	for _, p := range parked {
		reasons[p.ID] = p.Reason
	}
	if len(parked) != 2 || !utf8.ValidString(reasons[x1]) || !strings.HasPrefix(reasons[x1], "transform: xxx") ||
		!strings.HasPrefix(reasons[z1], "transform: raw bytes ") {
		t.Fatalf("parked: %+v", parked)
	}
	if p := b.pending(t); p != 2 {
		t.Fatalf("%d pending, want 2 (X1 and Z1 parked)", p)
	}
}

// A Transform that returns no envelope (or a nil one) for a row has given the
// broker nothing to confirm: the row is parked, not marked published with
// nothing sent (CONTRACT 4), and its aggregate waits; the others flow.
func TestTransformWithoutEnvelopesParksTheRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	cfg := b.config()
	cfg.Metrics = reg
	cfg.Transform = func(row *outbox.Row, env *envelope.Envelope) ([]*envelope.Envelope, error) {
		switch row.AggregateID {
		case "X":
			return nil, nil
		case "Z":
			return []*envelope.Envelope{env, nil}, nil
		}
		return []*envelope.Envelope{env}, nil
	}
	r := b.newRelay(t, cfg)
	x1 := b.enqueue(t, "X", relaytest.SeqPayload{Seq: 1})
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 2})
	b.enqueue(t, "Y", relaytest.SeqPayload{Seq: 1})
	z1 := b.enqueue(t, "Z", relaytest.SeqPayload{Seq: 1})
	if n := b.drainOnce(t, r); n != 1 {
		t.Fatalf("published %d, want 1 (Y1)", n)
	}
	if p := b.pending(t); p != 3 {
		t.Fatalf("%d pending, want 3 (X1 and Z1 parked, X2 waiting)", p)
	}
	parked, err := relay.Parked(ctx, b.s.Pool, b.s.Names())
	if err != nil {
		t.Fatal(err)
	}
	ids := map[uuid.UUID]bool{}
	for _, p := range parked {
		ids[p.ID] = strings.HasPrefix(p.Reason, "transform: ")
	}
	if len(parked) != 2 || !ids[x1] || !ids[z1] {
		t.Fatalf("parked: %+v", parked)
	}
	if v := metricValue(t, reg, relay.MetricPublished); v != 1 {
		t.Fatalf("%s = %v, want 1", relay.MetricPublished, v)
	}
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, 1))
	if len(copies) != 1 || len(perKey["Y"]) != 1 {
		t.Fatalf("topic: %v", perKey)
	}
}

// A payload the outbox accepts under its default limit is published, not
// parked, although PostgreSQL hands it back from JSONB with a space after
// every comma and colon (here 1.0 MB written, 1.5 MB read back).
func TestPayloadWithinTheOutboxLimitIsNotParked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: b.s.Names()}) // default MaxPayloadBytes
	payload := []byte(`{"seq":1,"v":[` + strings.Repeat("0,", 499_990) + `0]}`)
	err := pgx.BeginFunc(ctx, b.s.Pool, func(tx pgx.Tx) error {
		return ob.Enqueue(ctx, tx, &outbox.Event{Aggregate: "comanda", AggregateID: "X", Type: "comanda.creada", Payload: payload})
	})
	if err != nil {
		t.Fatalf("the outbox refused %d bytes: %v", len(payload), err)
	}
	b.enqueue(t, "X", relaytest.SeqPayload{Seq: 2})
	if n := b.drainOnce(t, b.newRelay(t, b.config())); n != 2 {
		t.Fatalf("published %d, want 2", n)
	}
	parked, err := relay.Parked(ctx, b.s.Pool, b.s.Names())
	if err != nil || len(parked) != 0 {
		t.Fatalf("parked: %+v (%v)", parked, err)
	}
	recs := b.read(t, 2)
	perKey, copies := relaytest.FirstSeqs(t, recs)
	if len(copies) != 2 || len(recs[0].Value) > envelope.DefaultMaxBytes {
		t.Fatalf("%d events, first record %d bytes", len(copies), len(recs[0].Value))
	}
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"X": 2})
}
