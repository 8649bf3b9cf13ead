package schema_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/schema"
)

func dualComandaCreada(t testing.TB) func(*outbox.Row, *envelope.Envelope) ([]*envelope.Envelope, error) {
	t.Helper()
	tr, err := schema.DualPublish(nil, schema.Dual{Type: "comanda.creada", Version: 2, Also: 1,
		Convert: schema.DropFields(1, "adreca_lliurament")})
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func row(t testing.TB, tipus string, versio int, dades any) *outbox.Row {
	t.Helper()
	id, err := uuid.NewV7()
	if err != nil {
		t.Fatal(err)
	}
	return &outbox.Row{ID: id, Aggregate: "comanda", AggregateID: "P-2026-000123", Type: tipus, Version: versio,
		Payload: mustJSON(t, dades), CreatedAt: time.UnixMilli(1789000000000)}
}

func encode(t testing.TB, e *envelope.Envelope) []byte {
	t.Helper()
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A producer in transition writes comanda.creada v2 and the relay publishes
// it as v2 and v1. The copies have distinct ids, stable across a
// republication, and one correlacio; a consumer accepting both versions
// decodes both and, keyed by the correlacio, applies the effect once.
func TestDualPublishPairIsHandledOnce(t *testing.T) {
	t.Parallel()
	tr := dualComandaCreada(t)
	r := row(t, "comanda.creada", 2, examples(t)[schema.Key{Type: "comanda.creada", Version: 2}])
	envs, err := tr(r, r.Envelope("comandes"))
	if err != nil {
		t.Fatal(err)
	}
	if len(envs) != 2 || envs[0].Version != 2 || envs[1].Version != 1 {
		t.Fatalf("want copies v2 then v1, got %d", len(envs))
	}
	if envs[0].ID != r.ID.String() || envs[1].ID == envs[0].ID {
		t.Fatalf("ids %s %s (row %s)", envs[0].ID, envs[1].ID, r.ID)
	}
	again, err := tr(r, r.Envelope("comandes"))
	if err != nil || again[0].ID != envs[0].ID || again[1].ID != envs[1].ID {
		t.Fatalf("republication changed the ids: %v", err)
	}
	for _, e := range envs {
		if got := string(e.Extra[schema.FieldCorrelation]); got != `"`+r.ID.String()+`"` {
			t.Fatalf("copy v%d correlacio %s", e.Version, got)
		}
		if schema.IdempotencyKey(e) != r.ID.String() {
			t.Fatalf("copy v%d key %s", e.Version, schema.IdempotencyKey(e))
		}
	}

	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	if _, err := s.Pool.Exec(ctx, "CREATE TABLE efectes (consumidor TEXT, versio INT)"); err != nil {
		t.Fatal(err)
	}
	ib := inbox.New(inbox.Config{Names: s.Names()})
	d := handlersDecoder(t)
	// run hands both copies to one consumer keyed by key and returns the
	// results and how many effects the pair produced.
	run := func(consumer string, key func(*envelope.Envelope) string) ([]inbox.Result, int) {
		t.Helper()
		var results []inbox.Result
		for _, e := range envs {
			got, err := d.Decode(encode(t, e)) // what the consumer receives
			if err != nil {
				t.Fatalf("copy v%d: %v", e.Version, err)
			}
			var c comandaCreada
			if err := got.DataAs(&c); err != nil {
				t.Fatal(err)
			}
			res, err := ib.Process(ctx, s.Pool, consumer, key(got), func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "INSERT INTO efectes VALUES ($1, $2)", consumer, e.Version)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			results = append(results, res)
		}
		var n int
		if err := s.Pool.QueryRow(ctx, "SELECT count(*) FROM efectes WHERE consumidor = $1", consumer).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return results, n
	}
	results, n := run("test.dual", schema.IdempotencyKey)
	if n != 1 || results[0] != inbox.Processed || results[1] != inbox.Duplicate {
		t.Fatalf("keyed by correlacio: %d effects, results %v; want the pair handled once", n, results)
	}
	// Keyed by id_esdeveniment instead, the pair runs twice: the correlacio
	// is what makes the difference.
	if _, n := run("test.dual.per_id", func(e *envelope.Envelope) string { return e.ID }); n != 2 {
		t.Fatalf("keyed by id_esdeveniment: %d effects, want 2", n)
	}
}

// A consumer that knows only v1 during the transition skips the v2 copy
// (ErrIgnored, no outcome) and handles the v1 copy; a plain v2 event, not
// part of a pair, is still a permanent "versio 2 not supported".
func TestOldConsumerSkipsTheNewerCopy(t *testing.T) {
	t.Parallel()
	old, err := schema.NewDecoder(schema.DecoderConfig{Handles: map[string]int{"comanda.creada": 1}})
	if err != nil {
		t.Fatal(err)
	}
	r := row(t, "comanda.creada", 2, examples(t)[schema.Key{Type: "comanda.creada", Version: 2}])
	envs, err := dualComandaCreada(t)(r, r.Envelope("comandes"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = old.Decode(encode(t, envs[0]))
	if !errors.Is(err, schema.ErrIgnored) || outcome.IsPermanent(err) {
		t.Fatalf("v2 copy: got %v", err)
	}
	env, err := old.Decode(encode(t, envs[1]))
	if err != nil || env.Version != 1 {
		t.Fatalf("v1 copy: %+v %v", env, err)
	}
	if _, err := old.Decode(encode(t, r.Envelope("comandes"))); !outcome.IsPermanent(err) || err.Error() != "esquema: versio 2 not supported" {
		t.Fatalf("lone v2: %v", err)
	}
	// A pair whose every copy is newer than the consumer knows goes to the DLQ.
	lone := r.Envelope("comandes")
	lone.Extra = map[string]json.RawMessage{schema.FieldPairVersions: json.RawMessage(`[3,2]`)}
	if _, err := old.Decode(encode(t, lone)); !outcome.IsPermanent(err) {
		t.Fatalf("pair of newer copies: %v", err)
	}
}

func TestDualPublishLeavesOtherRowsAlone(t *testing.T) {
	t.Parallel()
	tr := dualComandaCreada(t)
	for _, r := range []*outbox.Row{
		row(t, "pagament.confirmat", 1, examples(t)[schema.Key{Type: "pagament.confirmat", Version: 1}]),
		row(t, "comanda.creada", 1, examples(t)[schema.Key{Type: "comanda.creada", Version: 1}]),
	} {
		env := r.Envelope("x")
		out, err := tr(r, env)
		if err != nil || len(out) != 1 || out[0] != env || env.Extra != nil {
			t.Fatalf("%s v%d: %v %v", r.Type, r.Version, out, err)
		}
	}
}

func TestDualPublishRefusesAnInvalidCopy(t *testing.T) {
	t.Parallel()
	tr, err := schema.DualPublish(nil, schema.Dual{Type: "comanda.creada", Version: 2, Also: 1,
		Convert: schema.DropFields(1, "client")})
	if err != nil {
		t.Fatal(err)
	}
	r := row(t, "comanda.creada", 2, examples(t)[schema.Key{Type: "comanda.creada", Version: 2}])
	_, err = tr(r, r.Envelope("comandes"))
	if !outcome.IsPermanent(err) || !errors.Is(err, schema.ErrSchema) {
		t.Fatalf("got %v", err)
	}
	if want := "schema: dual copy: esquema: comanda.creada v1: /client: required field missing"; err.Error() != want {
		t.Fatalf("got %q want %q", err, want)
	}
	bad := func(e *envelope.Envelope) (*envelope.Envelope, error) { return e, nil } // forgets the versio
	tr, _ = schema.DualPublish(nil, schema.Dual{Type: "comanda.creada", Version: 2, Also: 1, Convert: bad})
	if _, err := tr(r, r.Envelope("comandes")); !outcome.IsPermanent(err) {
		t.Fatalf("wrong versio accepted: %v", err)
	}
	for name, d := range map[string]schema.Dual{
		"nil convert":    {Type: "comanda.creada", Version: 2, Also: 1},
		"same version":   {Type: "comanda.creada", Version: 2, Also: 2, Convert: schema.Bump},
		"unknown from":   {Type: "comanda.creada", Version: 4, Also: 1, Convert: schema.Bump},
		"unknown target": {Type: "comanda.creada", Version: 2, Also: 7, Convert: schema.Bump},
	} {
		if _, err := schema.DualPublish(nil, d); !errors.Is(err, schema.ErrConfig) {
			t.Errorf("%s: got %v", name, err)
		}
	}
}

// A correlacio PostgreSQL cannot store as a key (NUL byte, over
// envelope.MaxIDBytes) must not become the idempotency key: the inbox would
// refuse it at every attempt. The id_esdeveniment, which Decode checked, is
// the key instead, as consumer.IdempotencyKey does.
func TestIdempotencyKeyIgnoresACorrelacioThatCannotBeAKey(t *testing.T) {
	t.Parallel()
	for _, corr := range []string{`"a\u0000b"`, `"` + strings.Repeat("c", envelope.MaxIDBytes+1) + `"`} {
		env, err := envelope.Decode([]byte(`{"id_esdeveniment":"e-1","tipus":"t","versio":1,"dades":{},"correlacio":` + corr + `}`))
		if err != nil {
			t.Fatal(err)
		}
		if k := schema.IdempotencyKey(env); k != "e-1" || envelope.CheckKey(k) != nil {
			t.Errorf("correlacio %.12s…: key %.12q…, want the id_esdeveniment e-1", corr, k)
		}
	}
}
