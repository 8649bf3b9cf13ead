// Package schema makes the event-versioning (schema evolution) rules
// automatic. Every (tipus, versio) km0 publishes has a JSON Schema (directory
// schemas/, embedded by package schemas):
//
//   - producer side, Registry.Validate plugs into outbox.Config.Validate, so the
//     outbox refuses an event whose dades does not match its schema and no
//     invalid event reaches the broker;
//   - consumer side, Decoder.Decode plugs into the consumer's Decode hook: it
//     validates, upcasts older versions to the one the handler is written
//     against, and turns every contract failure into a permanent error whose
//     text starts with "esquema: " (the DLQ motiu of CONTRACT.md);
//   - Compare and CompareSets apply the compatibility rules between two
//     revisions of the schemas (km0 schema check);
//   - DualPublish builds the relay hook that publishes two versions of a tipus
//     during a producer transition.
//
// Validation uses github.com/santhosh-tekuri/jsonschema/v6; schemas are
// compiled once, when the Registry is built.
package schema

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/km0/km0/schemas"
)

// Key names one schema: a tipus and a versio.
type Key struct {
	Type    string // tipus, e.g. "comanda.creada"
	Version int    // versio, ≥ 1
}

func (k Key) String() string { return k.Type + " v" + strconv.Itoa(k.Version) }

// Path returns the key's file path relative to the schemas directory,
// "<tipus>/v<N>.json".
func (k Key) Path() string { return k.Type + "/v" + strconv.Itoa(k.Version) + ".json" }

var (
	typeRE = regexp.MustCompile(`^[a-z0-9_]+(\.[a-z0-9_]+)+$`)
	fileRE = regexp.MustCompile(`^v([1-9][0-9]{0,8})\.json$`)
)

// ParsePath parses "<tipus>/v<N>.json" (optionally under a leading directory,
// e.g. "schemas/comanda.creada/v2.json") into a Key. It returns ok = false for
// any other path.
func ParsePath(p string) (Key, bool) {
	dir, file := path.Split(p)
	m := fileRE.FindStringSubmatch(file)
	if m == nil {
		return Key{}, false
	}
	tipus := path.Base(strings.TrimSuffix(dir, "/"))
	if !typeRE.MatchString(tipus) {
		return Key{}, false
	}
	n, _ := strconv.Atoi(m[1])
	return Key{Type: tipus, Version: n}, true
}

// Registry holds compiled schemas. It is immutable after New and safe for
// concurrent use.
type Registry struct {
	docs    map[Key][]byte
	schemas map[Key]compiled
	latest  map[string]int
}

// compiled is one schema: the library's form, authoritative, and the fast
// form (nil when the schema leaves the fast subset, see fast.go).
type compiled struct {
	lib  *jsonschema.Schema
	fast *fastSchema
}

// validate checks data, a JSON value, against c. The fast path accepts what
// it can prove valid; everything else is decided, and worded, by the library.
func (c compiled) validate(k Key, context string, data []byte) error {
	if c.fast != nil && c.fast.valid(data) {
		return nil
	}
	var v any
	if err := json.Unmarshal(data, &v); err != nil {
		return &ValidationError{Key: k, Context: context, Problems: []Problem{{Path: "/", Message: "invalid JSON: " + err.Error()}}}
	}
	err := c.lib.Validate(v)
	if err == nil {
		return nil
	}
	var ve *jsonschema.ValidationError
	if !errors.As(err, &ve) {
		return &ValidationError{Key: k, Context: context, Problems: []Problem{{Path: "/", Message: err.Error()}}}
	}
	ps, more := problems(ve)
	return &ValidationError{Key: k, Context: context, Problems: ps, More: more}
}

// ErrSchema is the sentinel every schema error of this package matches with
// errors.Is: validation failures, unknown schemas, unsupported versions.
var ErrSchema = errors.New("esquema")

// New loads and compiles every <tipus>/v<N>.json of each source, in order; a
// later source replaces an earlier one's file for the same key (so
// New(schemas.FS, os.DirFS(dir)) overlays a directory on the embedded set).
// Files that do not match the naming scheme are an error, as are invalid JSON
// and invalid JSON Schema, each naming the file.
func New(sources ...fs.FS) (*Registry, error) {
	docs := map[Key][]byte{}
	for _, src := range sources {
		err := fs.WalkDir(src, ".", func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() || !strings.HasSuffix(p, ".json") {
				return nil
			}
			k, ok := ParsePath(p)
			if !ok || strings.Count(p, "/") != 1 {
				return fmt.Errorf("schema: %s: want <tipus>/v<N>.json", p)
			}
			b, err := fs.ReadFile(src, p)
			if err != nil {
				return fmt.Errorf("schema: %w", err)
			}
			docs[k] = b
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return compile(docs)
}

// FromDocs compiles schema documents keyed by Key (used by km0 schema check on
// files read from git).
func FromDocs(docs map[Key][]byte) (*Registry, error) { return compile(maps.Clone(docs)) }

func compile(docs map[Key][]byte) (*Registry, error) {
	r := &Registry{docs: docs, schemas: map[Key]compiled{}, latest: map[string]int{}}
	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft2020)
	keys := sortedKeys(docs)
	for _, k := range keys {
		doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(docs[k]))
		if err != nil {
			return nil, fmt.Errorf("schema: %s: invalid JSON: %w", k.Path(), err)
		}
		if err := c.AddResource(url(k), doc); err != nil {
			return nil, fmt.Errorf("schema: %s: %w", k.Path(), err)
		}
	}
	for _, k := range keys {
		s, err := c.Compile(url(k))
		if err != nil {
			return nil, fmt.Errorf("schema: %s: %w", k.Path(), err)
		}
		r.schemas[k] = compiled{lib: s, fast: compileFast(docs[k])}
		r.latest[k.Type] = max(r.latest[k.Type], k.Version)
	}
	return r, nil
}

func url(k Key) string { return "https://km0.invalid/schemas/" + k.Path() }

func sortedKeys(m map[Key][]byte) []Key {
	keys := make([]Key, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].Type != keys[j].Type {
			return keys[i].Type < keys[j].Type
		}
		return keys[i].Version < keys[j].Version
	})
	return keys
}

var defaultRegistry = sync.OnceValues(func() (*Registry, error) { return New(schemas.FS) })

// Default returns the registry of the embedded schemas (package schemas),
// compiled once per process. Its error is non-nil only if an embedded schema
// is broken, which the package's tests rule out.
func Default() (*Registry, error) { return defaultRegistry() }

// Keys returns every key, sorted by tipus then versio.
func (r *Registry) Keys() []Key { return sortedKeys(r.docs) }

// Has reports whether the registry has a schema for (tipus, versio).
func (r *Registry) Has(tipus string, versio int) bool {
	_, ok := r.schemas[Key{tipus, versio}]
	return ok
}

// Latest returns the newest versio of tipus, or 0 if the tipus is unknown.
func (r *Registry) Latest(tipus string) int { return r.latest[tipus] }

// Document returns the schema file of k as loaded, or nil.
func (r *Registry) Document(k Key) []byte { return r.docs[k] }

// Validate checks dades (a JSON object) against the schema of (tipus,
// versio). It returns nil, an *UnknownError when the registry has no such
// schema, or a *ValidationError naming each offending field, e.g.
// "esquema: comanda.creada v2: /linies/0/quantitat: must be >= 1 (got 0)".
// Both match ErrSchema. Its signature is outbox.Validator's, so
// outbox.Config{Validate: reg.Validate} makes the outbox refuse invalid events.
func (r *Registry) Validate(tipus string, versio int, dades []byte) error {
	k := Key{tipus, versio}
	c, ok := r.schemas[k]
	if !ok {
		return &UnknownError{Key: k}
	}
	return c.validate(k, "", dades)
}

// UnknownError says the registry has no schema for a (tipus, versio). On the
// producer side this refuses the write: every event km0 publishes must have a
// schema.
type UnknownError struct{ Key Key }

func (e *UnknownError) Error() string { return "esquema: " + e.Key.String() + ": no schema registered" }

// Is makes errors.Is(err, ErrSchema) true.
func (e *UnknownError) Is(target error) bool { return target == ErrSchema }
