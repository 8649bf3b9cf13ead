// Package strictjson decodes the JSON bodies of km0's HTTP APIs and messages
// so that every reader of a body sees the same values. encoding/json alone
// reads some bodies differently from other decoders (Python's json among
// them): it matches member names to struct fields case-insensitively, lets
// the last of two members with one name win, and replaces invalid UTF-8 and
// lone surrogate escapes (\ud800) with U+FFFD. Unmarshal refuses all of
// these before decoding, naming the offending member.
package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"
)

// MaxDepth bounds the nesting of arrays and objects (encoding/json's own limit).
const MaxDepth = 10000

// Error is a refused body. Path names the offending member or element, e.g.
// "client", "linies[1].producte"; "" means the body as a whole.
type Error struct {
	Path   string
	Reason string
}

func (e *Error) Error() string {
	if e.Path == "" {
		return e.Reason
	}
	return e.Path + ": " + e.Reason
}

// Options tune Unmarshal. The zero value ignores unknown members, as the
// CONTRACT's consumers do.
type Options struct {
	// DisallowUnknownFields refuses a member that matches no field of the
	// target struct. Default false: unknown members are ignored (still
	// checked for UTF-8 and duplicates).
	DisallowUnknownFields bool
}

// Unmarshal is Options{}.Unmarshal.
func Unmarshal(data []byte, v any) error { return Options{}.Unmarshal(data, v) }

// Unmarshal decodes data into v (a non-nil pointer) as encoding/json does,
// after checking the whole document, and sets v only when data passes: it
// decodes into a fresh value and stores it in *v, so members absent from
// data leave their fields zero, not as they were. It returns an *Error, and
// leaves v alone, for: malformed JSON or data after the value; a value of
// the wrong type for its field (Path from encoding/json's report); a
// string, member names included, holding invalid UTF-8 or an escaped lone
// surrogate; an object with two members of the same name (after
// unescaping); a member whose name matches a field of the target struct
// only when case is ignored (encoding/json would fill the field from it);
// an unknown member with DisallowUnknownFields; and nesting deeper than
// MaxDepth.
func (o Options) Unmarshal(data []byte, v any) error {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.IsNil() {
		return &Error{Reason: fmt.Sprintf("strictjson: Unmarshal needs a non-nil pointer, got %T", v)}
	}
	fresh := reflect.New(rv.Type().Elem())
	// encoding/json checks the syntax before it decodes anything; the walk
	// below relies on it.
	if err := json.Unmarshal(data, fresh.Interface()); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return &Error{Path: te.Field, Reason: "wrong type: expected " + jsonKind(te.Type) + ", got " + te.Value}
		}
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return &Error{Reason: "malformed JSON: " + err.Error()}
		}
		return &Error{Reason: err.Error()}
	}
	w := walker{data: data, opts: o}
	w.skipSpace()
	if err := w.value(rv.Type().Elem(), 0); err != nil {
		return err
	}
	rv.Elem().Set(fresh.Elem())
	return nil
}

type walker struct {
	data []byte
	i    int
	opts Options
	path []segment // of the value being checked; turned into a string only for an error
}

// segment is one step of a path: a member name, or an index when name is nil.
type segment struct {
	name  []byte
	index int
}

// fail returns an *Error at the current path.
func (w *walker) fail(format string, args ...any) error {
	var b strings.Builder
	for _, s := range w.path {
		if s.name == nil {
			b.WriteString("[" + strconv.Itoa(s.index) + "]")
			continue
		}
		if b.Len() > 0 {
			b.WriteByte('.')
		}
		b.Write(s.name)
	}
	return &Error{Path: b.String(), Reason: fmt.Sprintf(format, args...)}
}

func (w *walker) skipSpace() {
	for w.i < len(w.data) {
		switch w.data[w.i] {
		case ' ', '\t', '\r', '\n':
			w.i++
		default:
			return
		}
	}
}

var unmarshalerType = reflect.TypeFor[json.Unmarshaler]()

// target strips pointers from t and returns nil when its members are not
// matched to struct fields (any, json.Unmarshaler, scalars).
func target(t reflect.Type) reflect.Type {
	for t != nil {
		if reflect.PointerTo(t).Implements(unmarshalerType) || t.Implements(unmarshalerType) {
			return nil
		}
		if t.Kind() != reflect.Pointer {
			return t
		}
		t = t.Elem()
	}
	return nil
}

// value checks the value at w.i (already valid JSON) to be decoded into t
// (nil: not matched against a Go type).
func (w *walker) value(t reflect.Type, depth int) error {
	if depth > MaxDepth {
		return w.fail("more than %d levels of nesting", MaxDepth)
	}
	switch w.data[w.i] {
	case '"':
		_, err := w.str()
		return err
	case '{':
		return w.object(target(t), depth)
	case '[':
		t = target(t)
		var elem reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			elem = t.Elem()
		}
		w.i++
		w.skipSpace()
		w.path = append(w.path, segment{})
		for n := 0; w.data[w.i] != ']'; n++ {
			w.path[len(w.path)-1].index = n
			if err := w.value(elem, depth+1); err != nil {
				return err
			}
			w.skipSpace()
			if w.data[w.i] == ',' {
				w.i++
				w.skipSpace()
			}
		}
		w.path = w.path[:len(w.path)-1]
		w.i++
		return nil
	default: // number, true, false, null
		for w.i < len(w.data) {
			switch w.data[w.i] {
			case ',', '}', ']', ' ', '\t', '\r', '\n':
				return nil
			}
			w.i++
		}
		return nil
	}
}

func (w *walker) object(t reflect.Type, depth int) error {
	var fields map[string]reflect.Type
	var elem reflect.Type
	if t != nil {
		switch t.Kind() {
		case reflect.Struct:
			fields = fieldsOf(t)
		case reflect.Map:
			elem = t.Elem()
		}
	}
	var seenSmall [16][]byte
	seen := seenSmall[:0]
	var seenMap map[string]bool
	w.i++
	w.skipSpace()
	w.path = append(w.path, segment{})
	for w.data[w.i] != '}' {
		name, err := w.str()
		if err != nil {
			return err
		}
		w.path[len(w.path)-1] = segment{name: name}
		if seenMap != nil {
			if seenMap[string(name)] {
				return w.fail("repeated member")
			}
			seenMap[string(name)] = true
		} else {
			for _, n := range seen {
				if bytes.Equal(n, name) {
					return w.fail("repeated member")
				}
			}
			if seen = append(seen, name); len(seen) > len(seenSmall) {
				seenMap = make(map[string]bool, 2*len(seen))
				for _, n := range seen {
					seenMap[string(n)] = true
				}
			}
		}
		w.skipSpace()
		w.i++ // ':'
		w.skipSpace()
		vt := elem
		if fields != nil {
			ft, ok := fields[string(name)]
			if !ok {
				for f := range fields {
					if strings.EqualFold(f, string(name)) {
						return w.fail("unknown member (perhaps %q: names are case-sensitive)", f)
					}
				}
				if w.opts.DisallowUnknownFields {
					return w.fail("unknown member")
				}
			}
			vt = ft
		}
		if err := w.value(vt, depth+1); err != nil {
			return err
		}
		w.skipSpace()
		if w.data[w.i] == ',' {
			w.i++
			w.skipSpace()
		}
	}
	w.path = w.path[:len(w.path)-1]
	w.i++
	return nil
}

// str checks the string at w.i (its opening quote) and returns its value:
// a slice of the document when it has no escape, else a fresh copy.
func (w *walker) str() ([]byte, error) {
	start := w.i
	w.i++
	escaped := false
	for {
		c := w.data[w.i]
		switch {
		case c == '"':
			w.i++
			raw := w.data[start:w.i]
			if !escaped {
				return raw[1 : len(raw)-1 : len(raw)-1], nil
			}
			var s string
			_ = json.Unmarshal(raw, &s) // valid: checked above
			return []byte(s), nil
		case c == '\\':
			escaped = true
			if w.data[w.i+1] != 'u' {
				w.i += 2
				continue
			}
			r := hex4(w.data[w.i+2 : w.i+6])
			w.i += 6
			switch {
			case r >= 0xdc00 && r <= 0xdfff:
				return nil, w.fail(`\u%04x: unpaired UTF-16 surrogate`, r)
			case r >= 0xd800 && r <= 0xdbff:
				if !bytes.HasPrefix(w.data[w.i:], []byte(`\u`)) {
					return nil, w.fail(`\u%04x: unpaired UTF-16 surrogate`, r)
				}
				if lo := hex4(w.data[w.i+2 : w.i+6]); lo < 0xdc00 || lo > 0xdfff {
					return nil, w.fail(`\u%04x: unpaired UTF-16 surrogate`, r)
				}
				w.i += 6
			}
		case c < utf8.RuneSelf:
			w.i++
		default:
			r, size := utf8.DecodeRune(w.data[w.i:])
			if r == utf8.RuneError && size <= 1 {
				return nil, w.fail("invalid UTF-8 (byte 0x%02x at offset %d)", c, w.i)
			}
			w.i += size
		}
	}
}

func hex4(b []byte) rune {
	n, _ := strconv.ParseUint(string(b), 16, 32)
	return rune(n)
}

var fieldCache sync.Map // reflect.Type → map[string]reflect.Type

// fieldsOf returns the JSON member names of struct t (encoding/json's rules
// for tags, unexported and embedded fields) with their types.
func fieldsOf(t reflect.Type) map[string]reflect.Type {
	if f, ok := fieldCache.Load(t); ok {
		return f.(map[string]reflect.Type)
	}
	out := map[string]reflect.Type{}
	addFields(out, t, 0)
	fieldCache.Store(t, out)
	return out
}

func addFields(out map[string]reflect.Type, t reflect.Type, depth int) {
	if depth > 10 {
		return
	}
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" {
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				addFields(out, ft, depth+1)
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		if _, dup := out[name]; !dup || depth == 0 {
			out[name] = f.Type
		}
	}
}

// jsonKind names the JSON value a Go type decodes from, for an error a
// caller reads: never the Go type's name (a package path, a struct name).
func jsonKind(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Slice, reflect.Array:
		if t.Elem().Kind() == reflect.Uint8 && t.Kind() == reflect.Slice {
			return "a string (base64)"
		}
		return "an array"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	}
	return "another JSON value"
}
