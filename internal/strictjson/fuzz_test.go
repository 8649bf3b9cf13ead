package strictjson_test

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/km0/km0/internal/strictjson"
)

// FuzzStrictJSONMatchesEncodingJSON: strictjson is encoding/json with more
// refusals, never a different reading. Whatever strictjson accepts,
// encoding/json accepts too and decodes to the same value, into an any and
// into a struct (with and without DisallowUnknownFields); and a body
// strictjson accepts into the struct it also accepts into an any when
// encoding/json does (the struct only adds refusals: case-variant names,
// types, unknown members; it never skips a duplicate or invalid UTF-8 in a
// member it has no field for).
func FuzzStrictJSONMatchesEncodingJSON(f *testing.F) {
	for _, s := range []string{
		`{"id":"P-1","client":"C-1","linies":[{"producte":"pomes","quantitat":2}]}`,
		`{"id":"a","id":"b"}`,               // duplicate member
		`{"id":"a","\u0069d":"b"}`,          // duplicate after unescaping
		`{"ID":"a"}`, `{"Id":"a","id":"b"}`, // case-variant names
		`{"client":"\xff"}`, `{"\xfe":1}`, // invalid UTF-8
		`{"client":"\ud800"}`, `{"client":"\ud83d\ude00"}`, // lone and paired surrogates
		`{"linies":[{"quantitat":1e400}]}`, `{"linies":[{"quantitat":9223372036854775808}]}`, // big numbers
		`123456789012345678901234567890`, `-0`, `1e-400`, `0.1e1`,
		`{"extra":{"a":[1,{"b":null}]},"etiquetes":{"x":1,"X":2}}`,
		`{"etiquetes":{"x":1,"x":2}}`,
		`{"adreca_lliurament":null}`, `null`, `[]`, `""`, `{} {}`, `{}x`, ` {"id" : "a" } `,
		`[[[[[[[[[[]]]]]]]]]]`, `{"a":"\u0000"}`, "{\"a\":\"\t\"}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var sAny, jAny any
		errAny := strictjson.Unmarshal(data, &sAny)
		if errAny == nil {
			if err := json.Unmarshal(data, &jAny); err != nil {
				t.Fatalf("strictjson accepts %q into any, encoding/json refuses it: %v", data, err)
			}
			if !reflect.DeepEqual(sAny, jAny) {
				t.Fatalf("%q into any: strictjson %#v, encoding/json %#v", data, sAny, jAny)
			}
		}
		for _, o := range []strictjson.Options{{}, {DisallowUnknownFields: true}} {
			var sv, jv view
			err := o.Unmarshal(data, &sv)
			if err == nil {
				if jerr := json.Unmarshal(data, &jv); jerr != nil {
					t.Fatalf("strictjson %+v accepts %q, encoding/json refuses it: %v", o, data, jerr)
				}
				if !reflect.DeepEqual(sv, jv) {
					t.Fatalf("%q (%+v): strictjson %+v, encoding/json %+v", data, o, sv, jv)
				}
				// A struct skips what it has no field for (encoding/json too:
				// 1e700 in an unknown member); strictjson's own checks still
				// cover it, so where encoding/json reads the body into an any,
				// strictjson does too.
				if errAny != nil && json.Unmarshal(data, new(any)) == nil {
					t.Fatalf("strictjson %+v accepts %q into a struct but refuses it into any: %v", o, data, errAny)
				}
			}
		}
	})
}
