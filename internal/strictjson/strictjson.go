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

// Unmarshal decodes data into v (a non-nil pointer) with encoding/json
// after checking the whole document. It returns an *Error, and decodes
// nothing, for: malformed JSON or data after the value; a string, member
// names included, holding invalid UTF-8 or an escaped lone surrogate; an
// object with two members of the same name (after unescaping); a member
// whose name matches a field of the target struct only when case is ignored
// (encoding/json would fill the field from it); an unknown member with
// DisallowUnknownFields; nesting deeper than MaxDepth; and a value of the
// wrong type for its field (Path from encoding/json's report).
func (o Options) Unmarshal(data []byte, v any) error {
	if !json.Valid(data) {
		var probe any
		err := json.Unmarshal(data, &probe)
		msg := "JSON mal format"
		if err != nil {
			msg += ": " + err.Error()
		}
		return &Error{Reason: msg}
	}
	w := walker{data: data, opts: o}
	var t reflect.Type
	if rv := reflect.ValueOf(v); rv.Kind() == reflect.Pointer {
		t = rv.Type().Elem()
	}
	w.skipSpace()
	if err := w.value(t, "", 0); err != nil {
		return err
	}
	if err := json.Unmarshal(data, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return &Error{Path: te.Field, Reason: "tipus incorrecte: s'esperava " + te.Type.String()}
		}
		return &Error{Reason: err.Error()}
	}
	return nil
}

type walker struct {
	data []byte
	i    int
	opts Options
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
func (w *walker) value(t reflect.Type, path string, depth int) error {
	if depth > MaxDepth {
		return &Error{Path: path, Reason: fmt.Sprintf("més de %d nivells d'imbricació", MaxDepth)}
	}
	t = target(t)
	switch w.data[w.i] {
	case '"':
		_, err := w.str(path)
		return err
	case '{':
		return w.object(t, path, depth)
	case '[':
		var elem reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			elem = t.Elem()
		}
		w.i++
		w.skipSpace()
		for n := 0; w.data[w.i] != ']'; n++ {
			if err := w.value(elem, path+"["+strconv.Itoa(n)+"]", depth+1); err != nil {
				return err
			}
			w.skipSpace()
			if w.data[w.i] == ',' {
				w.i++
				w.skipSpace()
			}
		}
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

func (w *walker) object(t reflect.Type, path string, depth int) error {
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
	seen := map[string]bool{}
	w.i++
	w.skipSpace()
	for w.data[w.i] != '}' {
		name, err := w.str(path)
		if err != nil {
			return err
		}
		member := join(path, name)
		if seen[name] {
			return &Error{Path: member, Reason: "membre repetit"}
		}
		seen[name] = true
		w.skipSpace()
		w.i++ // ':'
		w.skipSpace()
		vt := elem
		if fields != nil {
			ft, ok := fields[name]
			if !ok {
				for f := range fields {
					if strings.EqualFold(f, name) {
						return &Error{Path: member, Reason: fmt.Sprintf("membre desconegut (potser %q: els noms distingeixen majúscules)", f)}
					}
				}
				if w.opts.DisallowUnknownFields {
					return &Error{Path: member, Reason: "membre desconegut"}
				}
			}
			vt = ft
		}
		if err := w.value(vt, member, depth+1); err != nil {
			return err
		}
		w.skipSpace()
		if w.data[w.i] == ',' {
			w.i++
			w.skipSpace()
		}
	}
	w.i++
	return nil
}

func join(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}

// str checks the string at w.i (its opening quote) and returns its value.
func (w *walker) str(path string) (string, error) {
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
				return string(raw[1 : len(raw)-1]), nil
			}
			var s string
			_ = json.Unmarshal(raw, &s) // valid: checked above
			return s, nil
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
				return "", &Error{Path: path, Reason: fmt.Sprintf(`\u%04x: substitut UTF-16 sense parella`, r)}
			case r >= 0xd800 && r <= 0xdbff:
				if !bytes.HasPrefix(w.data[w.i:], []byte(`\u`)) || w.i+6 > len(w.data) {
					return "", &Error{Path: path, Reason: fmt.Sprintf(`\u%04x: substitut UTF-16 sense parella`, r)}
				}
				if lo := hex4(w.data[w.i+2 : w.i+6]); lo < 0xdc00 || lo > 0xdfff {
					return "", &Error{Path: path, Reason: fmt.Sprintf(`\u%04x: substitut UTF-16 sense parella`, r)}
				}
				w.i += 6
			}
		case c < utf8.RuneSelf:
			w.i++
		default:
			r, size := utf8.DecodeRune(w.data[w.i:])
			if r == utf8.RuneError && size <= 1 {
				return "", &Error{Path: path, Reason: fmt.Sprintf("UTF-8 no vàlid (byte 0x%02x a la posició %d)", c, w.i)}
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
