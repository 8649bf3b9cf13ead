package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
)

// In WAL mode, with no slot (the shared server has none: wal_level =
// replica), every write is refused with ErrNoSlot naming the slot and the
// fix; the caller's transaction goes on and commits its own work; the
// outbox table gets nothing. The look at the slot is cached: within
// SlotCheckInterval, Enqueue runs no query for it.
func TestWALModeRefusesWritesWithoutItsSlot(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: s.Names(), Mode: outbox.ModeWAL, SlotCheckInterval: time.Hour})
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: map[string]any{"id": "P-1"}}
	err = ob.Enqueue(ctx, tx, e)
	if !errors.Is(err, outbox.ErrNoSlot) || !strings.Contains(err.Error(), "km0_wal_") || !strings.Contains(err.Error(), "km0 migrate --outbox-mode wal") {
		t.Fatalf("Enqueue: %v, want ErrNoSlot naming the slot and the fix", err)
	}
	err = ob.EnqueueBatch(ctx, tx, []*outbox.Event{
		{Aggregate: "comanda", AggregateID: "P-2", Type: "comanda.creada", Payload: map[string]any{"id": "P-2"}},
		{Aggregate: "comanda", AggregateID: "P-3", Type: "comanda.creada", Payload: map[string]any{"id": "P-3"}},
	})
	if !errors.Is(err, outbox.ErrNoSlot) {
		t.Fatalf("EnqueueBatch: %v, want ErrNoSlot", err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("the caller's transaction is unusable after a refusal: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, s, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("outbox table has %d rows, want 0", n)
	}
	// Cached: on a transaction where any query fails, the refusal still
	// comes from the last look, without a query.
	aborted, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer aborted.Rollback(ctx) //nolint:errcheck
	if _, err := aborted.Exec(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("1/0 did not fail")
	}
	if err := ob.Enqueue(ctx, aborted, e); !errors.Is(err, outbox.ErrNoSlot) {
		t.Fatalf("Enqueue within the check interval queried the server: %v", err)
	}
	bad := outbox.New(outbox.Config{Names: s.Names(), Mode: "wall"})
	if err := bad.Enqueue(ctx, s.Pool, e); !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), `"wall"`) {
		t.Fatalf("unknown mode: %v, want ErrInvalid naming it", err)
	}
}

// EncodeWAL's content (docs/contract.md) reads back whole with DecodeWAL,
// headers included; content that is not an event is refused naming why.
func TestWALContentRoundTripsAndRefusesForeignContent(t *testing.T) {
	t.Parallel()
	in := outbox.Row{ID: uuid.Must(uuid.NewV7()), Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Version: 2,
		Payload: []byte(`{"id":"P-1","total":12.5}`), CreatedAt: time.Date(2026, 12, 1, 10, 0, 0, 123456000, time.UTC),
		Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	b, err := outbox.EncodeWAL(&in)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"v":1,"id":"` + in.ID.String() + `","agregat":"comanda","agregat_id":"P-1","tipus":"comanda.creada","versio":2,` +
		`"creat_en":"2026-12-01T10:00:00.123456Z","carrega":{"id":"P-1","total":12.5},` +
		`"capcaleres":{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}`
	if string(b) != want {
		t.Fatalf("content\n%s\nwant\n%s", b, want)
	}
	out, hdrErr, err := outbox.DecodeWAL(b)
	if err != nil || hdrErr != nil {
		t.Fatal(err, hdrErr)
	}
	if out.ID != in.ID || out.AggregateID != in.AggregateID || out.Version != 2 || !out.CreatedAt.Equal(in.CreatedAt) ||
		string(out.Payload) != string(in.Payload) || out.Headers["traceparent"] != in.Headers["traceparent"] {
		t.Fatalf("decoded %+v, want %+v", out, in)
	}
	// Strings that need escaping, and invalid UTF-8 (read back as U+FFFD).
	odd := in
	odd.AggregateID, odd.Type = "P-\"1\"\\\n\t\x01 è 😀", "comanda.creada\xff"
	b, err = outbox.EncodeWAL(&odd)
	if err != nil {
		t.Fatal(err)
	}
	back, _, err := outbox.DecodeWAL(b)
	if err != nil || back.AggregateID != odd.AggregateID || back.Type != "comanda.creada\ufffd" {
		t.Fatalf("odd strings: %q %q (%v) from %s", back.AggregateID, back.Type, err, b)
	}
	if _, err := outbox.EncodeWAL(&outbox.Row{Payload: []byte("{nope")}); err == nil {
		t.Fatal("EncodeWAL accepted a payload that is not JSON")
	}
	for content, why := range map[string]string{
		`not json`: "not a JSON object",
		`{"v":2}`:  "v 2",
		`{"v":1,"id":"x","agregat":"a","agregat_id":"b","tipus":"t","versio":1,"creat_en":"2026-12-01T10:00:00Z","carrega":{}}`:                      `id "x"`,
		`{"v":1,"id":"` + in.ID.String() + `","agregat":"a","agregat_id":"b","tipus":"t","versio":1,"creat_en":"2026-12-01T10:00:00Z","carrega":[]}`: "carrega",
	} {
		if _, _, err := outbox.DecodeWAL([]byte(content)); err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("DecodeWAL(%s): %v, want an error saying %q", content, err, why)
		}
	}
}
