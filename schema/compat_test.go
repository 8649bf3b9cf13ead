package schema_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/km0/km0/schema"
)

const baseDoc = `{
  "type": "object",
  "description": "base",
  "required": ["id", "linies"],
  "properties": {
    "id": {"type": "string", "minLength": 1},
    "nota": {"type": "string"},
    "estat": {"type": "string", "enum": ["creada", "pagada"]},
    "linies": {"type": "array", "minItems": 1, "items": {
      "type": "object", "required": ["quantitat"],
      "properties": {"quantitat": {"type": "integer", "minimum": 1}, "producte": {"type": "string"}}}}
  }
}`

// edit returns baseDoc changed by f (on a fresh copy).
func edit(t *testing.T, f func(d map[string]any)) []byte {
	t.Helper()
	var d map[string]any
	if err := json.Unmarshal([]byte(baseDoc), &d); err != nil {
		t.Fatal(err)
	}
	f(d)
	return mustJSON(t, d)
}

func props(d map[string]any) map[string]any { return d["properties"].(map[string]any) }

func lineProps(d map[string]any) map[string]any {
	return props(d)["linies"].(map[string]any)["items"].(map[string]any)["properties"].(map[string]any)
}

// Each rule, allowed and refused, on the same versio.
func TestCompareRules(t *testing.T) {
	t.Parallel()
	k := schema.Key{Type: "comanda.creada", Version: 1}
	cases := []struct {
		name  string
		edit  func(d map[string]any)
		want  string // "" = allowed; else "<field>: <rule>"
		extra int    // further violations expected beside want
	}{
		{"identical", func(map[string]any) {}, "", 0},
		{"add optional field", func(d map[string]any) { props(d)["adreca_lliurament"] = map[string]any{"type": "object"} }, "", 0},
		{"add optional nested field", func(d map[string]any) { lineProps(d)["unitat"] = map[string]any{"type": "string"} }, "", 0},
		{"edit description", func(d map[string]any) {
			d["description"] = "changed"
			props(d)["id"].(map[string]any)["description"] = "x"
		}, "", 0},
		{"add enum value", func(d map[string]any) {
			props(d)["estat"].(map[string]any)["enum"] = []any{"creada", "pagada", "enviada"}
		}, "", 0},
		{"drop enum", func(d map[string]any) { delete(props(d)["estat"].(map[string]any), "enum") }, "", 0},
		{"relax bound", func(d map[string]any) { lineProps(d)["quantitat"].(map[string]any)["minimum"] = 0 }, "", 0},
		{"drop bound", func(d map[string]any) { delete(props(d)["id"].(map[string]any), "minLength") }, "", 0},
		{"drop items schema", func(d map[string]any) { delete(props(d)["linies"].(map[string]any), "items") }, "", 0},
		{"additionalProperties true", func(d map[string]any) { d["additionalProperties"] = true }, "", 0},

		{"remove field", func(d map[string]any) { delete(props(d), "nota") }, "nota: remove", 0},
		{"remove nested field", func(d map[string]any) { delete(lineProps(d), "producte") }, "linies[].producte: remove", 0},
		{"remove required field", func(d map[string]any) {
			delete(props(d), "id")
			d["required"] = []any{"linies"}
		}, "id: remove", 0},
		{"rename field", func(d map[string]any) { props(d)["comentari"] = props(d)["nota"]; delete(props(d), "nota") }, "nota: rename", 0},
		{"retype field", func(d map[string]any) { props(d)["id"].(map[string]any)["type"] = "integer" }, "id: retype", 0},
		{"retype nested field", func(d map[string]any) { lineProps(d)["quantitat"].(map[string]any)["type"] = "number" }, "linies[].quantitat: retype", 0},
		{"widen type", func(d map[string]any) { props(d)["nota"].(map[string]any)["type"] = []any{"string", "null"} }, "nota: retype", 0},
		{"optional becomes required", func(d map[string]any) { d["required"] = []any{"id", "linies", "nota"} }, "nota: require", 0},
		{"new required field", func(d map[string]any) {
			props(d)["mercat"] = map[string]any{"type": "string"}
			d["required"] = []any{"id", "linies", "mercat"}
		}, "mercat: require", 0},
		{"required becomes optional", func(d map[string]any) { d["required"] = []any{"linies"} }, "id: unrequire", 0},
		{"narrow enum", func(d map[string]any) { props(d)["estat"].(map[string]any)["enum"] = []any{"creada"} }, "estat: enum", 0},
		{"enum on a free field", func(d map[string]any) { props(d)["nota"].(map[string]any)["enum"] = []any{"a"} }, "nota: enum", 0},
		{"const on a free field", func(d map[string]any) { props(d)["nota"].(map[string]any)["const"] = "a" }, "nota: enum", 0},
		{"tighten minimum", func(d map[string]any) { lineProps(d)["quantitat"].(map[string]any)["minimum"] = 2 }, "linies[].quantitat: narrow", 0},
		{"add maxLength", func(d map[string]any) { props(d)["nota"].(map[string]any)["maxLength"] = 10 }, "nota: narrow", 0},
		{"add pattern", func(d map[string]any) { props(d)["id"].(map[string]any)["pattern"] = "^P-" }, "id: narrow", 0},
		{"raise minItems", func(d map[string]any) { props(d)["linies"].(map[string]any)["minItems"] = 2 }, "linies: narrow", 0},
		{"close the object", func(d map[string]any) { d["additionalProperties"] = false }, "dades: closed", 0},
		{"close a nested object", func(d map[string]any) {
			props(d)["linies"].(map[string]any)["items"].(map[string]any)["additionalProperties"] = false
		}, "linies[]: closed", 0},
		{"composition changed", func(d map[string]any) { d["allOf"] = []any{map[string]any{"required": []any{"nota"}}} }, "dades: unchecked", 0},
		{"remove and retype together", func(d map[string]any) {
			delete(props(d), "nota")
			props(d)["id"].(map[string]any)["type"] = "integer"
		}, "id: retype", 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			vs := schema.Compare(k, []byte(baseDoc), edit(t, tc.edit))
			if tc.want == "" {
				if len(vs) > 0 {
					t.Fatalf("compatible change refused: %v", vs)
				}
				return
			}
			found := false
			for _, v := range vs {
				if v.Field+": "+string(v.Rule) == tc.want {
					found = true
					if !strings.HasPrefix(v.String(), "comanda.creada v1: "+tc.want+" (") {
						t.Errorf("message %q does not name the schema, field and rule", v)
					}
				}
			}
			if !found || len(vs) != 1+tc.extra {
				t.Fatalf("want %q (+%d), got %v", tc.want, tc.extra, vs)
			}
		})
	}
}

func TestCompareSets(t *testing.T) {
	t.Parallel()
	v1 := []byte(baseDoc)
	k1 := schema.Key{Type: "comanda.creada", Version: 1}
	k2 := schema.Key{Type: "comanda.creada", Version: 2}
	other := schema.Key{Type: "comanda.pagada", Version: 1}
	breaking := edit(t, func(d map[string]any) { delete(props(d), "nota"); props(d)["id"].(map[string]any)["type"] = "integer" })
	cases := []struct {
		name     string
		old, new map[schema.Key][]byte
		want     []string // "<key>: <field>: <rule>"
	}{
		{"unchanged", map[schema.Key][]byte{k1: v1}, map[schema.Key][]byte{k1: v1}, nil},
		{"new versio may break, old file stays", map[schema.Key][]byte{k1: v1}, map[schema.Key][]byte{k1: v1, k2: breaking}, nil},
		{"new tipus", map[schema.Key][]byte{k1: v1}, map[schema.Key][]byte{k1: v1, other: []byte(`{"type":"object"}`)}, nil},
		{"first schemas", nil, map[schema.Key][]byte{k1: v1}, nil},
		{"old versio deleted", map[schema.Key][]byte{k1: v1}, map[schema.Key][]byte{k2: breaking},
			[]string{"comanda.creada v1: dades: delete-version"}},
		{"breaking change in place", map[schema.Key][]byte{k1: v1}, map[schema.Key][]byte{k1: breaking},
			[]string{"comanda.creada v1: id: retype", "comanda.creada v1: nota: remove"}},
		{"invalid JSON", map[schema.Key][]byte{k1: v1}, map[schema.Key][]byte{k1: []byte(`{"type":`)},
			[]string{"comanda.creada v1: dades: invalid"}},
		{"invalid JSON Schema", nil, map[schema.Key][]byte{k1: []byte(`{"type":"objecte"}`)},
			[]string{"comanda.creada v1: dades: invalid"}},
		{"closed new file", nil, map[schema.Key][]byte{other: []byte(`{"type":"object","additionalProperties":false}`)},
			[]string{"comanda.pagada v1: dades: closed"}},
		{"closed in place, reported once", map[schema.Key][]byte{k1: v1}, map[schema.Key][]byte{k1: edit(t, func(d map[string]any) { d["additionalProperties"] = false })},
			[]string{"comanda.creada v1: dades: closed"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, v := range schema.CompareSets(tc.old, tc.new) {
				got = append(got, fmt.Sprintf("%s: %s: %s", v.Key, v.Field, v.Rule))
			}
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Fatalf("got\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(tc.want, "\n  "))
			}
		})
	}
}

// The embedded schemas are compatible with themselves and v1 → v2 of
// comanda.creada is, schema-wise, only an added optional field: the contract
// bumps the versio for what it means to repartiment, not for its shape.
func TestEmbeddedComandaCreadaV2IsV1PlusAnOptionalField(t *testing.T) {
	t.Parallel()
	reg := registry(t)
	v1 := reg.Document(schema.Key{Type: "comanda.creada", Version: 1})
	v2 := reg.Document(schema.Key{Type: "comanda.creada", Version: 2})
	if vs := schema.Compare(schema.Key{Type: "comanda.creada", Version: 2}, v1, v2); len(vs) > 0 {
		t.Fatalf("v1 → v2: %v", vs)
	}
}
