package outbox_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
)

func TestEnqueueWritesInsideTheCallersTransaction(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: s.Names()})

	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: map[string]any{"id": "P-1"}}
	if err := ob.Enqueue(ctx, tx, e); err != nil {
		t.Fatal(err)
	}
	if e.ID == uuid.Nil || e.Version != 1 {
		t.Fatalf("id not set or versio not defaulted: %+v", e)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, s, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("rolled-back enqueue left %d rows", n)
	}

	tx, _ = s.Pool.Begin(ctx)
	batch := []*outbox.Event{
		{Aggregate: "comanda", AggregateID: "P-2", Type: "comanda.creada", Payload: []byte(`{"n":1}`)},
		{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Payload: []byte(`{"n":2}`)},
		{Aggregate: "comanda", AggregateID: "P-2", Type: "comanda.pagada", Version: 2, Payload: []byte(`{"n":3}`)},
	}
	if err := ob.EnqueueBatch(ctx, tx, batch); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, s, "SELECT count(*) FROM outbox WHERE publicat_en IS NULL"); n != 3 {
		t.Fatalf("want 3 pending rows, got %d", n)
	}
	// Within P-2, creat_en follows the order given.
	rows, err := s.Pool.Query(ctx, "SELECT carrega->>'n' FROM outbox WHERE agregat_id = 'P-2' ORDER BY creat_en, id")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var n string
		_ = rows.Scan(&n)
		got = append(got, n)
	}
	if strings.Join(got, ",") != "1,3" {
		t.Fatalf("P-2 order %v, want 1,3", got)
	}
	for _, e := range batch {
		if n := count(t, s, "SELECT count(*) FROM outbox WHERE id = '"+e.ID.String()+"'"); n != 1 {
			t.Fatalf("event id %s not the row id", e.ID)
		}
	}
}

func TestEnqueueRefusesInvalidEvents(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: s.Names(), MaxPayloadBytes: 100,
		Validate: func(tipus string, versio int, carrega []byte) error {
			if tipus == "refusat" {
				return errors.New("dades.id: missing")
			}
			return nil
		}})
	cases := map[string]*outbox.Event{
		"agregat is empty":        {AggregateID: "x", Type: "t", Payload: []byte(`{}`)},
		"agregat_id is empty":     {Aggregate: "a", Type: "t", Payload: []byte(`{}`)},
		"tipus is empty":          {Aggregate: "a", AggregateID: "x", Payload: []byte(`{}`)},
		"not valid JSON":          {Aggregate: "a", AggregateID: "x", Type: "t", Payload: []byte(`{`)},
		"must be a JSON object":   {Aggregate: "a", AggregateID: "x", Type: "t", Payload: []byte(`[1]`)},
		"over the limit":          {Aggregate: "a", AggregateID: "x", Type: "t", Payload: []byte(`{"p":"` + strings.Repeat("x", 200) + `"}`)},
		"dades.id: missing":       {Aggregate: "a", AggregateID: "x", Type: "refusat", Payload: []byte(`{}`)},
		"carrega: missing":        {Aggregate: "a", AggregateID: "x", Type: "t"},
		"over the column's limit": {Aggregate: "a", AggregateID: "x", Type: "t", Version: math.MaxInt32 + 1, Payload: []byte(`{}`)},
	}
	for want, e := range cases {
		err := ob.Enqueue(ctx, s.Pool, e)
		if !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v", want, err)
		}
	}
	if n := count(t, s, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("invalid events wrote %d rows", n)
	}
}

func count(t *testing.T, s *pgtest.Schema, q string) int {
	t.Helper()
	var n int
	if err := s.Pool.QueryRow(context.Background(), q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// EnqueueBatch names an invalid event by its index in the caller's slice,
// not in the agregat_id order it inserts in.
func TestEnqueueBatchNamesTheInvalidEventByItsIndex(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ob := outbox.New(outbox.Config{Names: s.Names()})
	batch := []*outbox.Event{
		{Aggregate: "comanda", AggregateID: "P-2", Type: "comanda.creada", Payload: []byte(`{}`)},
		{Aggregate: "comanda", AggregateID: "P-3", Type: "comanda.creada", Payload: []byte(`{}`)},
		{Aggregate: "comanda", AggregateID: "P-1", Type: "", Payload: []byte(`{}`)},
	}
	err := ob.EnqueueBatch(context.Background(), s.Pool, batch)
	if !errors.Is(err, outbox.ErrInvalid) || !strings.HasPrefix(err.Error(), "event 2: ") {
		t.Fatalf("got %v, want event 2 named", err)
	}
	if n := count(t, s, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("an invalid batch wrote %d rows", n)
	}
}
