package schema

import (
	"bytes"
	"encoding/json"
	"os"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// agree checks the fast path's one promise on b: it accepts only JSON the
// library accepts. With complete, and no escapes or duplicate keys in b, it
// must also accept everything the library accepts, or the fast path would
// silently not be taken.
func agree(t *testing.T, k Key, c compiled, b []byte, complete bool) {
	t.Helper()
	fast := c.fast.valid(b)
	var v any
	lib := json.Unmarshal(b, &v) == nil && c.lib.Validate(v) == nil
	if fast && !lib {
		t.Fatalf("%s: fast path accepted what the library refuses: %s", k, b)
	}
	if complete && lib && !fast && !bytes.ContainsRune(b, '\\') {
		t.Fatalf("%s: fast path did not accept valid %s", k, b)
	}
}

func embedded(t *testing.T) *Registry {
	t.Helper()
	r, err := Default()
	if err != nil {
		t.Fatal(err)
	}
	for k, c := range r.schemas {
		if c.fast == nil {
			t.Fatalf("%s leaves the fast subset: validation of it would be slow", k)
		}
	}
	return r
}

// mutations returns v with, in turn, each value anywhere in it replaced by
// each of a set of troublesome values, each object member removed, and each
// array emptied.
func mutations(v any) []any {
	repl := []any{nil, true, -1.0, 0.0, 1.0, 1.5, 1e300, "", "é", "x", []any{}, map[string]any{}}
	var out []any
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			for _, m := range append(mutations(e), "__remove__") {
				c := map[string]any{}
				for k2, e2 := range x {
					c[k2] = e2
				}
				if m == "__remove__" {
					delete(c, k)
				} else {
					c[k] = m
				}
				out = append(out, c)
			}
		}
	case []any:
		out = append(out, []any{})
		for i, e := range x {
			for _, m := range mutations(e) {
				c := append([]any(nil), x...)
				c[i] = m
				out = append(out, c)
			}
		}
	}
	return append(out, repl...)
}

func TestFastPathAgreesWithLibraryOnMutations(t *testing.T) {
	t.Parallel()
	r := embedded(t)
	b, err := os.ReadFile("testdata/examples.json")
	if err != nil {
		t.Fatal(err)
	}
	var ex map[string]any
	if err := json.Unmarshal(b, &ex); err != nil {
		t.Fatal(err)
	}
	req := compiled{fast: compileFast([]byte(`{"required":["adreca_lliurament"],"properties":{"motiu":{"enum":["a","ciutat_no_coberta"]},"abans":{"exclusiveMaximum":5}}}`))}
	if req.fast == nil {
		t.Fatal("requirement left the fast subset")
	}
	req.lib = mustCompile(t, `{"required":["adreca_lliurament"],"properties":{"motiu":{"enum":["a","ciutat_no_coberta"]},"abans":{"exclusiveMaximum":5}}}`)
	n := 0
	for _, e := range ex {
		for _, m := range mutations(e) {
			doc, _ := json.Marshal(m)
			for k, c := range r.schemas {
				agree(t, k, c, doc, true)
				n++
			}
			agree(t, Key{"requisit", 1}, req, doc, true)
		}
	}
	if n < 1000 {
		t.Fatalf("only %d checks", n)
	}
}

func mustCompile(t testing.TB, src string) *jsonschema.Schema {
	t.Helper()
	s, err := compileRequirement("test", src)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestFastPathSyntax(t *testing.T) {
	t.Parallel()
	r := embedded(t)
	c := r.schemas[Key{"estoc.actualitzat", 1}]
	for _, in := range []string{
		`{"producte":"p","abans":1,"despres":0,"motiu":"m"}`,
		` {"producte":"p","abans":1.0,"despres":0e0,"motiu":"m","x":[1,{"y":null},true,false,-0.5e+3,"\u00e9\n"]} `,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m"} x`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m",}`,
		`{"producte":"p","abans":01,"despres":0,"motiu":"m"}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","x":[1,]}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","x":"\x"}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","x":"` + "\x01" + `"}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","x":tru}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","x":-}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","x":1.}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","x":1e}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","x":"\u12"}`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m"`,
		`{"producte":"p","abans":1,"despres":0,"motiu":"m","producte":7}`,
		`{"pro\u0064ucte":"p","abans":1,"despres":0,"motiu":"m"}`,
		`{"producte":"\u0070","abans":1,"despres":0,"motiu":"m"}`,
		`{"producte":"p","abans":1e400,"despres":0,"motiu":"m"}`,
		``, `[]`, `{`, `"`,
	} {
		agree(t, Key{"estoc.actualitzat", 1}, c, []byte(in), false)
		if c.fast.valid([]byte(in)) && !json.Valid([]byte(in)) {
			t.Fatalf("fast path accepted invalid JSON %q", in)
		}
	}
}

func TestFastSubset(t *testing.T) {
	t.Parallel()
	for src, want := range map[string]bool{
		`{"type":"object","properties":{"a":{"type":["string","null"],"maxLength":3}}}`: true,
		`{"type":"integer","minimum":0,"maximum":10}`:                                   true,
		`{"type":"number","exclusiveMinimum":0}`:                                        true,
		`{"enum":["a",1,true,null]}`:                                                    true,
		`{"const":"a"}`:                                                                 true,
		`{"minimum":0.5}`:                                                               false,
		`{"minimum":0,"exclusiveMinimum":0}`:                                            false,
		`{"enum":[{"a":1}]}`:                                                            false,
		`{"enum":["a"],"const":"a"}`:                                                    false,
		`{"allOf":[{}]}`:                                                                false,
		`{"pattern":"^a"}`:                                                              false,
		`{"$ref":"#/$defs/x","$defs":{"x":{}}}`:                                         false,
		`{"additionalProperties":{"type":"string"}}`:                                    false,
		`{"items":[{}]}`:                                                                false,
		`{"type":"objecte"}`:                                                            false,
		`{"properties":{"a":true}}`:                                                     false,
		`true`:                                                                          false,
	} {
		if got := compileFast([]byte(src)) != nil; got != want {
			t.Errorf("compileFast(%s) = %v, want %v", src, got, want)
		}
	}
}

func FuzzFastPathAgreesWithLibrary(f *testing.F) {
	b, err := os.ReadFile("testdata/examples.json")
	if err != nil {
		f.Fatal(err)
	}
	var ex map[string]json.RawMessage
	if err := json.Unmarshal(b, &ex); err != nil {
		f.Fatal(err)
	}
	for _, e := range ex {
		f.Add([]byte(e))
	}
	f.Add([]byte(`{"id":"P-1","client":"a","mercat":"m","linies":[{"producte":"p","quantitat":1e0,"preu_centims":0.0}]}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := embedded(t)
		for k, c := range r.schemas {
			agree(t, k, c, in, false)
		}
		if r.schemas[Key{"comanda.creada", 2}].fast.valid(in) && !json.Valid(in) {
			t.Fatalf("fast path accepted invalid JSON %q", in)
		}
	})
}
