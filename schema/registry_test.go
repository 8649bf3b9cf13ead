package schema_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
	"github.com/km0/km0/schemas"
)

// examples returns one complete, valid dades per embedded schema, keyed by
// schema path, from testdata/examples.json.
func examples(t testing.TB) map[schema.Key]map[string]any {
	t.Helper()
	b, err := os.ReadFile("testdata/examples.json")
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]map[string]any
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	out := map[schema.Key]map[string]any{}
	for p, v := range raw {
		k, ok := schema.ParsePath(p)
		if !ok {
			t.Fatalf("bad example key %q", p)
		}
		out[k] = v
	}
	return out
}

func registry(t testing.TB) *schema.Registry {
	t.Helper()
	reg, err := schema.Default()
	if err != nil {
		t.Fatalf("embedded schemas: %v", err)
	}
	return reg
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestEmbeddedSchemasCompileAndEachHasAnExample(t *testing.T) {
	t.Parallel()
	reg := registry(t)
	ex := examples(t)
	var keys []schema.Key
	for k := range ex {
		keys = append(keys, k)
	}
	if got := reg.Keys(); len(got) != len(keys) {
		t.Fatalf("registry has %v, examples cover %v: add an example for every schema", got, keys)
	}
	want := []string{"comanda.cancellada v1", "comanda.creada v1", "comanda.creada v2", "comanda.pagada v1", "estoc.actualitzat v1",
		"estoc.refusat v1", "pagament.confirmat v1", "repartiment.assignat v1", "repartiment.cobertura v1", "repartiment.rebutjat v1"}
	var got []string
	for _, k := range reg.Keys() {
		got = append(got, k.String())
		if err := reg.Validate(k.Type, k.Version, mustJSON(t, ex[k])); err != nil {
			t.Errorf("example of %s: %v", k, err)
		}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("schemas %v, want %v", got, want)
	}
	if reg.Latest("comanda.creada") != 2 || reg.Latest("nope") != 0 {
		t.Fatalf("Latest: %d %d", reg.Latest("comanda.creada"), reg.Latest("nope"))
	}
}

// withExtras adds unknown fields to the object and to every nested object
// and array item, as a newer producer might.
func withExtras(v any) any {
	switch x := v.(type) {
	case map[string]any:
		out := map[string]any{"camp_nou": "x", "altre_camp_nou": map[string]any{"n": 1}}
		for k, e := range x {
			out[k] = withExtras(e)
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = withExtras(e)
		}
		return out
	}
	return v
}

// minimal keeps only the top-level fields the schema requires: an event from
// a producer that never sets optional ones.
func minimal(t testing.TB, reg *schema.Registry, k schema.Key, v map[string]any) map[string]any {
	t.Helper()
	var doc struct {
		Required []string `json:"required"`
	}
	if err := json.Unmarshal(reg.Document(k), &doc); err != nil {
		t.Fatal(err)
	}
	out := map[string]any{}
	for _, f := range doc.Required {
		out[f] = v[f]
	}
	return out
}

func TestSchemasAreTolerantReaders(t *testing.T) {
	t.Parallel()
	reg := registry(t)
	for k, ex := range examples(t) {
		t.Run(k.String(), func(t *testing.T) {
			if err := reg.Validate(k.Type, k.Version, mustJSON(t, withExtras(ex))); err != nil {
				t.Errorf("unknown fields refused: %v", err)
			}
			m := minimal(t, reg, k, ex)
			if err := reg.Validate(k.Type, k.Version, mustJSON(t, m)); err != nil {
				t.Errorf("missing optional fields refused: %v", err)
			}
			if v := schema.Lint(k, reg.Document(k)); len(v) > 0 {
				t.Errorf("lint: %v", v)
			}
		})
	}
}

func TestValidateNamesTheField(t *testing.T) {
	t.Parallel()
	reg := registry(t)
	cases := []struct {
		name, tipus string
		versio      int
		dades, want string
	}{
		{"quantity below 1", "comanda.creada", 2,
			`{"id":"P-1","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":0,"preu_centims":100}]}`,
			"esquema: comanda.creada v2: /linies/0/quantitat: must be >= 1 (got 0)"},
		{"quantity as string", "comanda.creada", 2,
			`{"id":"P-1","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":"2","preu_centims":100}]}`,
			"esquema: comanda.creada v2: /linies/0/quantitat: must be integer (got string)"},
		{"fractional quantity", "comanda.creada", 1,
			`{"id":"P-1","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1.5,"preu_centims":100}]}`,
			"esquema: comanda.creada v1: /linies/0/quantitat: must be integer (got number)"},
		{"missing client", "comanda.creada", 1,
			`{"id":"P-1","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":100}]}`,
			"esquema: comanda.creada v1: /client: required field missing"},
		{"no lines", "comanda.creada", 2, `{"id":"P-1","client":"anna","mercat":"girona","linies":[]}`,
			"esquema: comanda.creada v2: /linies: must have at least 1 item(s) (got 0)"},
		{"address without city", "comanda.creada", 2,
			`{"id":"P-1","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":100}],"adreca_lliurament":{"codi_postal":"17001"}}`,
			"esquema: comanda.creada v2: /adreca_lliurament/ciutat: required field missing"},
		{"empty product", "estoc.actualitzat", 1, `{"producte":"","abans":1,"despres":0,"motiu":"comanda"}`,
			"esquema: estoc.actualitzat v1: /producte: must not be empty"},
		{"negative stock", "estoc.actualitzat", 1, `{"producte":"carbasso","abans":1,"despres":-1,"motiu":"comanda"}`,
			"esquema: estoc.actualitzat v1: /despres: must be >= 0 (got -1)"},
		{"three problems at once", "pagament.confirmat", 1, `{"import_centims":-5,"ref_passarella":7}`,
			"esquema: pagament.confirmat v1: /comanda_id: required field missing; /import_centims: must be >= 0 (got -5); /ref_passarella: must be string (got number)"},
		{"more than shown", "comanda.creada", 1, `{"linies":"x"}`,
			"esquema: comanda.creada v1: /client: required field missing; /id: required field missing; /linies: must be array (got string) (+1 more)"},
		{"not an object", "comanda.pagada", 1, `[1]`, "esquema: comanda.pagada v1: /: must be object (got array)"},
		{"not JSON", "comanda.pagada", 1, `{`, "esquema: comanda.pagada v1: /: invalid JSON"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := reg.Validate(tc.tipus, tc.versio, []byte(tc.dades))
			var ve *schema.ValidationError
			if !errors.As(err, &ve) || !errors.Is(err, schema.ErrSchema) {
				t.Fatalf("want a *ValidationError, got %T %v", err, err)
			}
			if !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("error\n  %q\nwant\n  %q", err, tc.want)
			}
		})
	}
}

func TestValidateRefusesUnknownSchemas(t *testing.T) {
	t.Parallel()
	reg := registry(t)
	for _, k := range []schema.Key{{Type: "comanda.esborrada", Version: 1}, {Type: "comanda.creada", Version: 3}} {
		err := reg.Validate(k.Type, k.Version, []byte(`{}`))
		var ue *schema.UnknownError
		if !errors.As(err, &ue) || !errors.Is(err, schema.ErrSchema) || err.Error() != "esquema: "+k.String()+": no schema registered" {
			t.Fatalf("%s: got %v", k, err)
		}
	}
}

// The producer side: the outbox, configured with Registry.Validate, refuses an
// invalid event with an error naming the field and writes nothing, so the
// relay can never publish it.
func TestOutboxRefusesInvalidEvents(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	ctx := context.Background()
	ob := outbox.New(outbox.Config{Names: s.Names(), Validate: registry(t).Validate})
	bad := &outbox.Event{Aggregate: "comanda", AggregateID: "P-1", Type: "comanda.creada", Version: 2,
		Payload: json.RawMessage(`{"id":"P-1","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":0,"preu_centims":100}]}`)}
	good := &outbox.Event{Aggregate: "comanda", AggregateID: "P-2", Type: "comanda.creada", Version: 2,
		Payload: map[string]any{"id": "P-2", "client": "anna", "mercat": "girona",
			"linies": []map[string]any{{"producte": "carbasso", "quantitat": 1, "preu_centims": 100}}}}
	unknown := &outbox.Event{Aggregate: "comanda", AggregateID: "P-3", Type: "comanda.creada", Version: 9, Payload: json.RawMessage(`{}`)}

	err := ob.Enqueue(ctx, s.Pool, bad)
	if !errors.Is(err, outbox.ErrInvalid) || !errors.Is(err, schema.ErrSchema) ||
		!strings.Contains(err.Error(), "esquema: comanda.creada v2: /linies/0/quantitat: must be >= 1") {
		t.Fatalf("invalid event: got %v", err)
	}
	if err := ob.Enqueue(ctx, s.Pool, unknown); !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), "comanda.creada v9: no schema registered") {
		t.Fatalf("unknown versio: got %v", err)
	}
	if err := ob.EnqueueBatch(ctx, s.Pool, []*outbox.Event{good, bad}); !errors.Is(err, schema.ErrSchema) {
		t.Fatalf("batch with an invalid event: got %v", err)
	}
	if n := countRows(t, s); n != 0 {
		t.Fatalf("%d rows written by refused calls", n)
	}
	good.ID = [16]byte{}
	if err := ob.Enqueue(ctx, s.Pool, good); err != nil {
		t.Fatalf("valid event refused: %v", err)
	}
	if n := countRows(t, s); n != 1 {
		t.Fatalf("want 1 row, got %d", n)
	}
}

func countRows(t *testing.T, s *pgtest.Schema) int {
	t.Helper()
	var n int
	if err := s.Pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestNewOverlaysADirectoryAndNamesBadFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(p, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, p), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("comanda.creada/v3.json", `{"type":"object","required":["id"]}`)
	reg, err := schema.New(schemas.FS, os.DirFS(dir))
	if err != nil {
		t.Fatal(err)
	}
	if reg.Latest("comanda.creada") != 3 || !reg.Has("comanda.pagada", 1) {
		t.Fatalf("overlay not applied: latest %d", reg.Latest("comanda.creada"))
	}
	if err := reg.Validate("comanda.creada", 3, []byte(`{}`)); err == nil || !strings.Contains(err.Error(), "/id: required field missing") {
		t.Fatalf("overlay schema not used: %v", err)
	}

	write("comanda.creada/v4.json", `{"type":"objecte"}`)
	if _, err := schema.New(os.DirFS(dir)); err == nil || !strings.Contains(err.Error(), "comanda.creada/v4.json") {
		t.Fatalf("invalid schema not named: %v", err)
	}
	_ = os.Remove(filepath.Join(dir, "comanda.creada/v4.json"))
	write("comanda.creada/v4.json", `{"type":`)
	if _, err := schema.New(os.DirFS(dir)); err == nil || !strings.Contains(err.Error(), "comanda.creada/v4.json: invalid JSON") {
		t.Fatalf("invalid JSON not named: %v", err)
	}
	_ = os.Remove(filepath.Join(dir, "comanda.creada/v4.json"))
	write("comanda.creada/latest.json", `{}`)
	if _, err := schema.New(os.DirFS(dir)); err == nil || !strings.Contains(err.Error(), "comanda.creada/latest.json: want <tipus>/v<N>.json") {
		t.Fatalf("misnamed file not refused: %v", err)
	}
}

func TestParsePath(t *testing.T) {
	t.Parallel()
	for p, want := range map[string]schema.Key{
		"comanda.creada/v2.json":             {Type: "comanda.creada", Version: 2},
		"schemas/estoc.actualitzat/v10.json": {Type: "estoc.actualitzat", Version: 10},
	} {
		if k, ok := schema.ParsePath(p); !ok || k != want {
			t.Errorf("ParsePath(%q) = %v %v", p, k, ok)
		}
	}
	for _, p := range []string{"comanda/v1.json", "comanda.creada/v0.json", "comanda.creada/v01.json", "comanda.creada/v1.yaml", "Comanda.creada/v1.json", "v1.json"} {
		if k, ok := schema.ParsePath(p); ok {
			t.Errorf("ParsePath(%q) accepted as %v", p, k)
		}
	}
}
