package schema

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"sort"
	"strings"
)

// Rule names one schema-evolution compatibility rule as `km0 schema
// check` applies it to two revisions of the same <tipus>/v<N>.json.
type Rule string

// The rules. Under the same versio, only compatible changes are allowed:
// adding an optional field, widening (dropping or relaxing a bound, adding an
// enum value), editing descriptions. A new versio file may change anything,
// because it is compared with nothing; a new tipus likewise.
const (
	// RuleRemove: a field was removed.
	RuleRemove Rule = "remove"
	// RuleRename: a field was removed and another with the same schema added.
	RuleRename Rule = "rename"
	// RuleRetype: a field's type changed (narrowed, widened or replaced).
	RuleRetype Rule = "retype"
	// RuleRequire: an optional field became required, or a new field was
	// added as required (events already written lack it).
	RuleRequire Rule = "require"
	// RuleUnrequire: a required field became optional; readers that rely on
	// it break (a reader's KeyError: 'adreca_lliurament').
	RuleUnrequire Rule = "unrequire"
	// RuleEnum: an enum (or const) lost values or appeared on a free field.
	RuleEnum Rule = "enum"
	// RuleNarrow: a bound was tightened or added (minimum, maxLength,
	// minItems, pattern, format, multipleOf, items...), so events already
	// written may no longer validate.
	RuleNarrow Rule = "narrow"
	// RuleClosed: additionalProperties is false (or a schema): the schema is
	// no longer a tolerant reader.
	RuleClosed Rule = "closed"
	// RuleUnchecked: a composition keyword ($ref, allOf, anyOf, oneOf, not,
	// if/then/else, $defs...) changed; the checker does not analyse these, so
	// the change needs a new versio.
	RuleUnchecked Rule = "unchecked"
	// RuleDeleteVersion: a published versio file was deleted. Old events of
	// that versio stay in the topics and must remain readable.
	RuleDeleteVersion Rule = "delete-version"
	// RuleInvalid: the file is not valid JSON or not a valid JSON Schema.
	RuleInvalid Rule = "invalid"
)

// Violation is one refused change.
type Violation struct {
	Key    Key
	Field  string // e.g. "linies[].quantitat"; "dades" for the whole object
	Rule   Rule
	Detail string
}

func (v Violation) String() string {
	return fmt.Sprintf("%s: %s: %s (%s)", v.Key, v.Field, v.Rule, v.Detail)
}

// CompareSets compares every schema of old (a published revision) with new
// (the candidate), keyed by Key. It reports deleted versio files, every
// incompatible change to a file present in both, closed objects and files
// that do not compile in new. Files only in new are checked for validity and
// tolerance but compared with nothing. The result is sorted by key, field and
// rule; empty means compatible.
func CompareSets(old, new map[Key][]byte) []Violation {
	var out []Violation
	for k := range old {
		if _, ok := new[k]; !ok {
			out = append(out, Violation{Key: k, Field: "dades", Rule: RuleDeleteVersion, Detail: k.Path() + " was deleted; keep it while events of this versio may exist"})
		}
	}
	for k, doc := range new {
		if _, err := FromDocs(map[Key][]byte{k: doc}); err != nil {
			out = append(out, Violation{Key: k, Field: "dades", Rule: RuleInvalid, Detail: err.Error()})
			continue
		}
		closed := map[string]bool{}
		if prev, ok := old[k]; ok && string(prev) != string(doc) {
			for _, v := range Compare(k, prev, doc) {
				closed[v.Field] = closed[v.Field] || v.Rule == RuleClosed
				out = append(out, v)
			}
		}
		for _, v := range Lint(k, doc) {
			if !closed[v.Field] { // Compare already reported this object closing
				out = append(out, v)
			}
		}
	}
	sortViolations(out)
	return out
}

func sortViolations(v []Violation) {
	sort.SliceStable(v, func(i, j int) bool {
		a, b := v[i], v[j]
		if a.Key != b.Key {
			if a.Key.Type != b.Key.Type {
				return a.Key.Type < b.Key.Type
			}
			return a.Key.Version < b.Key.Version
		}
		if a.Field != b.Field {
			return a.Field < b.Field
		}
		if a.Rule != b.Rule {
			return a.Rule < b.Rule
		}
		return a.Detail < b.Detail
	})
}

// Compare applies the rules to two revisions of the schema of k: old as
// published, new as proposed. Invalid JSON in either is a RuleInvalid
// violation. The result is sorted; empty means the change is compatible.
func Compare(k Key, old, new []byte) []Violation {
	o, err := parseDoc(old)
	if err != nil {
		return []Violation{{Key: k, Field: "dades", Rule: RuleInvalid, Detail: "published revision: " + err.Error()}}
	}
	n, err := parseDoc(new)
	if err != nil {
		return []Violation{{Key: k, Field: "dades", Rule: RuleInvalid, Detail: err.Error()}}
	}
	c := &comparer{key: k}
	c.node("", o, n)
	sortViolations(c.out)
	return c.out
}

// Lint reports the parts of a schema that make it intolerant: an object
// whose additionalProperties is false or a schema (RuleClosed).
func Lint(k Key, doc []byte) []Violation {
	d, err := parseDoc(doc)
	if err != nil {
		return []Violation{{Key: k, Field: "dades", Rule: RuleInvalid, Detail: err.Error()}}
	}
	c := &comparer{key: k}
	c.lint("", d)
	sortViolations(c.out)
	return c.out
}

func parseDoc(b []byte) (map[string]any, error) {
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		return nil, fmt.Errorf("invalid JSON: %v", err)
	}
	m, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("a schema must be a JSON object")
	}
	return m, nil
}

type comparer struct {
	key Key
	out []Violation
}

func (c *comparer) add(path string, r Rule, format string, args ...any) {
	if path == "" {
		path = "dades"
	}
	c.out = append(c.out, Violation{Key: c.key, Field: path, Rule: r, Detail: fmt.Sprintf(format, args...)})
}

func join(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}

// Keywords the checker does not analyse: any change to them is refused.
var opaque = []string{"$ref", "$dynamicRef", "$defs", "definitions", "allOf", "anyOf", "oneOf", "not",
	"if", "then", "else", "dependentRequired", "dependentSchemas", "patternProperties",
	"propertyNames", "prefixItems", "contains", "unevaluatedProperties", "unevaluatedItems"}

// Lower bounds (a higher new value narrows) and upper bounds (a lower one does).
var (
	lowerBounds = []string{"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"}
	upperBounds = []string{"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"}
	exactBounds = []string{"pattern", "format", "multipleOf", "uniqueItems"}
)

func (c *comparer) node(path string, o, n map[string]any) {
	if ot, nt := types(o), types(n); !slices.Equal(ot, nt) {
		c.add(path, RuleRetype, "type %s → %s", typeString(ot), typeString(nt))
	}
	c.enum(path, o, n)
	for _, kw := range lowerBounds {
		c.bound(path, kw, o, n, func(ov, nv float64) bool { return nv > ov })
	}
	for _, kw := range upperBounds {
		c.bound(path, kw, o, n, func(ov, nv float64) bool { return nv < ov })
	}
	for _, kw := range exactBounds {
		if nv, ok := n[kw]; ok && !reflect.DeepEqual(o[kw], nv) {
			c.add(path, RuleNarrow, "%s %s → %s", kw, show(o[kw]), show(nv))
		}
	}
	for _, kw := range opaque {
		if !reflect.DeepEqual(o[kw], n[kw]) {
			c.add(path, RuleUnchecked, "%s changed; the checker does not analyse it, publish a new versio", kw)
		}
	}
	if closes(o["additionalProperties"], n["additionalProperties"]) {
		c.add(path, RuleClosed, "additionalProperties %s → %s", show(o["additionalProperties"]), show(n["additionalProperties"]))
	}
	c.properties(path, o, n)
	c.items(path, o, n)
}

func (c *comparer) properties(path string, o, n map[string]any) {
	op, np := object(o["properties"]), object(n["properties"])
	oreq, nreq := stringSet(o["required"]), stringSet(n["required"])
	var removed, added []string
	for name := range op {
		if _, ok := np[name]; !ok {
			removed = append(removed, name)
		}
	}
	for name := range np {
		if _, ok := op[name]; !ok {
			added = append(added, name)
		}
	}
	sort.Strings(removed)
	sort.Strings(added)
	for _, name := range removed {
		if to := sameSchema(op[name], np, added); to != "" {
			c.add(join(path, name), RuleRename, "renamed to %s", join(path, to))
		} else {
			c.add(join(path, name), RuleRemove, "field removed")
		}
	}
	for name := range nreq {
		if oreq[name] {
			continue
		}
		if _, existed := op[name]; existed || !slices.Contains(added, name) {
			c.add(join(path, name), RuleRequire, "optional field became required")
		} else {
			c.add(join(path, name), RuleRequire, "new field added as required; add it as optional, or publish a new versio")
		}
	}
	for name := range oreq {
		if _, still := np[name]; !nreq[name] && (still || op[name] == nil) {
			c.add(join(path, name), RuleUnrequire, "required field became optional")
		}
	}
	for name, os := range op {
		if ns, ok := np[name]; ok {
			om, nm := object(os), object(ns)
			if om != nil && nm != nil {
				c.node(join(path, name), om, nm)
			} else if !reflect.DeepEqual(os, ns) {
				c.add(join(path, name), RuleRetype, "schema %s → %s", show(os), show(ns))
			}
		}
	}
}

func (c *comparer) items(path string, o, n map[string]any) {
	oi, ni := o["items"], n["items"]
	switch {
	case ni == nil:
		// Dropping the items schema widens: allowed.
	case oi == nil:
		c.add(path+"[]", RuleNarrow, "items schema added")
	default:
		om, nm := object(oi), object(ni)
		if om != nil && nm != nil {
			c.node(path+"[]", om, nm)
		} else if !reflect.DeepEqual(oi, ni) {
			c.add(path+"[]", RuleRetype, "items %s → %s", show(oi), show(ni))
		}
	}
}

func (c *comparer) enum(path string, o, n map[string]any) {
	ov, oHas := enumValues(o)
	nv, nHas := enumValues(n)
	if !nHas {
		return // no enum now: widened or unchanged
	}
	if !oHas {
		c.add(path, RuleEnum, "enum %s added to a free field", show(nv))
		return
	}
	var lost []any
	for _, v := range ov {
		if !slices.ContainsFunc(nv, func(x any) bool { return reflect.DeepEqual(x, v) }) {
			lost = append(lost, v)
		}
	}
	if len(lost) > 0 {
		c.add(path, RuleEnum, "enum narrowed: %s removed", show(lost))
	}
}

func (c *comparer) bound(path, kw string, o, n map[string]any, narrower func(ov, nv float64) bool) {
	nv, nOK := number(n[kw])
	if !nOK {
		return // absent now: relaxed or unchanged
	}
	ov, oOK := number(o[kw])
	if !oOK || narrower(ov, nv) {
		c.add(path, RuleNarrow, "%s %s → %s", kw, show(o[kw]), show(n[kw]))
	}
}

func (c *comparer) lint(path string, d map[string]any) {
	if closes(nil, d["additionalProperties"]) {
		c.add(path, RuleClosed, "additionalProperties is %s; schemas must let readers ignore unknown fields", show(d["additionalProperties"]))
	}
	for name, s := range object(d["properties"]) {
		if m := object(s); m != nil {
			c.lint(join(path, name), m)
		}
	}
	if m := object(d["items"]); m != nil {
		c.lint(path+"[]", m)
	}
}

// closes reports whether additionalProperties went from open (absent or
// true) to closed (false or a schema).
func closes(o, n any) bool {
	open := func(v any) bool { b, ok := v.(bool); return v == nil || (ok && b) }
	return open(o) && !open(n)
}

func sameSchema(s any, np map[string]any, added []string) string {
	for _, a := range added {
		if reflect.DeepEqual(s, np[a]) {
			return a
		}
	}
	return ""
}

func enumValues(m map[string]any) ([]any, bool) {
	if e, ok := m["enum"].([]any); ok {
		return e, true
	}
	if v, ok := m["const"]; ok {
		return []any{v}, true
	}
	return nil, false
}

func types(m map[string]any) []string {
	var out []string
	switch t := m["type"].(type) {
	case string:
		out = []string{t}
	case []any:
		for _, x := range t {
			if s, ok := x.(string); ok {
				out = append(out, s)
			}
		}
	}
	sort.Strings(out)
	return out
}

func typeString(t []string) string {
	if len(t) == 0 {
		return "(any)"
	}
	return strings.Join(t, "|")
}

func object(v any) map[string]any { m, _ := v.(map[string]any); return m }

func stringSet(v any) map[string]bool {
	out := map[string]bool{}
	if a, ok := v.([]any); ok {
		for _, x := range a {
			if s, ok := x.(string); ok {
				out[s] = true
			}
		}
	}
	return out
}

func number(v any) (float64, bool) { f, ok := v.(float64); return f, ok }

func show(v any) string {
	if v == nil {
		return "(none)"
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	const n = 60
	if len(b) > n {
		return string(b[:n]) + "…"
	}
	return string(b)
}
