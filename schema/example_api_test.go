package schema_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing/fstest"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/schema"
)

// What km0 schema check refuses within one versio: Compare the published
// revision with the proposed one; Lint flags a schema that is not a tolerant
// reader. Each Violation names its Rule.
func ExampleCompare() {
	k := schema.Key{Type: "comanda.creada", Version: 2}
	old := []byte(`{"type":"object","required":["id"],"properties":{"id":{"type":"string"},"nota":{"type":"string"}}}`)
	proposed := []byte(`{"type":"object","required":["id","client"],"additionalProperties":false,
		"properties":{"id":{"type":"integer"},"client":{"type":"string"}}}`)
	var refused []schema.Violation = schema.Compare(k, old, proposed)
	for _, v := range refused {
		fmt.Println(v.Rule, v.Field)
	}
	for _, v := range schema.Lint(k, proposed) {
		fmt.Println(v.Rule == schema.RuleClosed, v.Field)
	}
	// Output:
	// require client
	// closed dades
	// retype id
	// rename nota
	// true dades
}

// The rules Compare and CompareSets apply, as km0 schema check prints them.
func ExampleRule() {
	for _, r := range []schema.Rule{schema.RuleRemove, schema.RuleRename, schema.RuleRetype, schema.RuleRequire,
		schema.RuleUnrequire, schema.RuleEnum, schema.RuleNarrow, schema.RuleClosed, schema.RuleUnchecked,
		schema.RuleDeleteVersion, schema.RuleInvalid} {
		fmt.Print(r, " ")
	}
	fmt.Println()
	// Output:
	// remove rename retype require unrequire enum narrow closed unchecked delete-version invalid
}

// A registry of a service's own schemas, from a directory tree
// (<tipus>/v<N>.json) or, in a test, from a map of documents.
func ExampleNew() {
	reg, err := schema.New(fstest.MapFS{
		"vals.emes/v1.json": {Data: []byte(`{"type":"object","required":["codi"]}`)},
		"vals.emes/v2.json": {Data: []byte(`{"type":"object","required":["codi","import_centims"]}`)},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(reg.Latest("vals.emes"), string(reg.Document(schema.Key{Type: "vals.emes", Version: 1})))
	same, err := schema.FromDocs(map[schema.Key][]byte{{Type: "vals.emes", Version: 1}: []byte(`{"type":"object","required":["codi"]}`)})
	fmt.Println(same.Latest("vals.emes"), err)
	// Output:
	// 2 {"type":"object","required":["codi"]}
	// 1 <nil>
}

// Every schema error matches ErrSchema (a permanent failure: the consumer
// dead-letters it); errors.As gives the details. A ValidationError keeps at
// most MaxProblemsKept problems and its message shows MaxProblemsShown.
func ExampleValidationError() {
	reg, err := schema.FromDocs(map[schema.Key][]byte{{Type: "vals.emes", Version: 1}: []byte(
		`{"type":"object","required":["codi"],"properties":{"import_centims":{"type":"integer","minimum":1}}}`)})
	if err != nil {
		fmt.Println(err)
		return
	}
	explain := func(err error) {
		var (
			ve *schema.ValidationError
			ue *schema.UnknownError
			vr *schema.VersionError
			up *schema.UpcastError
		)
		switch {
		case errors.As(err, &ve):
			var p []schema.Problem = ve.Problems
			fmt.Println("invalid:", len(p), "problems, first", p[0].Path, "| own requirement:", ve.Context == schema.RequireContext)
		case errors.As(err, &ue):
			fmt.Println("no schema for", ue.Key)
		case errors.As(err, &vr):
			fmt.Println("versio", vr.Key.Version, "outside", vr.Min, "..", vr.Max)
		case errors.As(err, &up):
			fmt.Println("cannot upcast", up.Key, "to", up.Target, up.Reason)
		}
		fmt.Println(errors.Is(err, schema.ErrSchema))
	}
	explain(reg.Validate("vals.emes", 1, []byte(`{"import_centims":0}`)))
	explain(reg.Validate("vals.emes", 7, []byte(`{}`)))
	fmt.Println(schema.MaxProblemsShown, schema.MaxProblemsKept)
	// Output:
	// invalid: 2 problems, first /codi | own requirement: false
	// true
	// no schema for vals.emes v7
	// true
	// 3 64
}

// NewDecoder refuses a configuration it cannot honour with ErrConfig.
func ExampleNewDecoder_invalid() {
	_, err := schema.NewDecoder(schema.DecoderConfig{Handles: map[string]int{"comanda.creada": 0}})
	fmt.Println(errors.Is(err, schema.ErrConfig))
	// Output:
	// true
}

// The copies of a dual-published event share FieldCorrelation, so a
// consumer that records IdempotencyKey handles the pair once;
// FieldPairVersions lists the versions published. A copy newer than the
// handler knows, while it knows another copy of the pair, fails with an
// *IgnoredError (errors.Is ErrIgnored): skipped, not dead-lettered.
func ExampleIdempotencyKey() {
	v2 := &envelope.Envelope{ID: "6f1c9e2a-0000-4000-8000-000000000002", Extra: map[string]json.RawMessage{
		schema.FieldCorrelation:  json.RawMessage(`"6f1c9e2a-0000-4000-8000-0000000000aa"`),
		schema.FieldPairVersions: json.RawMessage(`[2,1]`),
	}}
	v1 := &envelope.Envelope{ID: "6f1c9e2a-0000-4000-8000-000000000001", Extra: map[string]json.RawMessage{
		schema.FieldCorrelation: json.RawMessage(`"6f1c9e2a-0000-4000-8000-0000000000aa"`),
	}}
	fmt.Println(schema.IdempotencyKey(v2) == schema.IdempotencyKey(v1), schema.IdempotencyKey(v1))
	var ignored error = &schema.IgnoredError{Key: schema.Key{Type: "comanda.creada", Version: 2}, Target: 1}
	fmt.Println(errors.Is(ignored, schema.ErrIgnored))
	// Output:
	// true 6f1c9e2a-0000-4000-8000-0000000000aa
	// true
}
