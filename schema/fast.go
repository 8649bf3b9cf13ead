package schema

import (
	"encoding/json"
	"math"
	"strconv"
	"unicode/utf8"
	"unsafe"
)

// The fast path. Walking a decoded document with the library costs tens of
// µs and ~300 allocations for a comanda.creada, dominated by building the
// generic value and by big.Rat arithmetic on every number. km0's schemas use
// a small subset of JSON Schema, so each schema that stays inside it is also
// compiled into a fastSchema that checks the raw bytes in one pass, without
// allocating.
//
// The fast path may only say "valid" or "don't know": when it does not
// accept a document, the library validates it and produces the error. So it
// can never refuse a valid event, and it accepts only what the library
// accepts (FuzzFastPathAgreesWithLibrary checks both directions).

const (
	tNull uint8 = 1 << iota
	tBool
	tObject
	tArray
	tNumber
	tInteger
	tString
)

type fastSchema struct {
	types              uint8 // 0: any type
	fields             map[string]fastField
	required           uint64 // one bit per required field (fastField.bit)
	closed             bool   // additionalProperties: false
	items              *fastSchema
	minItems, maxItems int // -1: no bound
	minLen, maxLen     int
	minimum, maximum   float64
	hasMin, hasMax     bool
	xmin, xmax         bool // the bounds are exclusive
	enum               []any
}

type fastField struct {
	sub *fastSchema // nil: any value
	bit uint64      // non-zero for a required field
}

// Keywords the fast path ignores because they never affect validity.
var annotations = map[string]bool{"$schema": true, "$id": true, "$comment": true, "title": true,
	"description": true, "examples": true, "default": true, "deprecated": true, "readOnly": true,
	"writeOnly": true, "format": true}

// compileFast returns the fast form of a schema document, or nil when the
// document uses anything outside the subset (the library alone then
// validates it).
func compileFast(doc []byte) *fastSchema {
	var v any
	if json.Unmarshal(doc, &v) != nil {
		return nil
	}
	f, ok := fastNode(v)
	if !ok {
		return nil
	}
	return f
}

func fastNode(v any) (*fastSchema, bool) {
	m, ok := v.(map[string]any)
	if !ok {
		return nil, false // boolean schemas: leave them to the library
	}
	f := &fastSchema{minItems: -1, maxItems: -1, minLen: -1, maxLen: -1}
	for kw, val := range m {
		var ok bool
		switch kw {
		case "type":
			f.types, ok = fastTypes(val)
		case "properties":
			ok = f.fastProperties(val)
		case "required":
			ok = true // below, once properties are known
		case "additionalProperties":
			b, isBool := val.(bool)
			f.closed, ok = isBool && !b, isBool
		case "items":
			f.items, ok = fastNode(val)
		case "minItems":
			f.minItems, ok = count(val)
		case "maxItems":
			f.maxItems, ok = count(val)
		case "minLength":
			f.minLen, ok = count(val)
		case "maxLength":
			f.maxLen, ok = count(val)
		case "minimum", "exclusiveMinimum":
			f.minimum, ok = exactBound(val)
			f.hasMin, f.xmin = true, kw == "exclusiveMinimum"
		case "maximum", "exclusiveMaximum":
			f.maximum, ok = exactBound(val)
			f.hasMax, f.xmax = true, kw == "exclusiveMaximum"
		case "enum", "const":
			ok = f.fastEnum(kw, val)
		default:
			ok = annotations[kw]
		}
		if !ok {
			return nil, false
		}
	}
	if _, both := m["minimum"]; both && m["exclusiveMinimum"] != nil {
		return nil, false
	}
	if _, both := m["maximum"]; both && m["exclusiveMaximum"] != nil {
		return nil, false
	}
	return f, f.fastRequired(m["required"])
}

func fastTypes(v any) (uint8, bool) {
	names := []any{v}
	if a, ok := v.([]any); ok {
		names = a
	}
	var t uint8
	for _, n := range names {
		switch n {
		case "null":
			t |= tNull
		case "boolean":
			t |= tBool
		case "object":
			t |= tObject
		case "array":
			t |= tArray
		case "number":
			t |= tNumber | tInteger
		case "integer":
			t |= tInteger
		case "string":
			t |= tString
		default:
			return 0, false
		}
	}
	return t, t != 0
}

func (f *fastSchema) fastProperties(v any) bool {
	m, ok := v.(map[string]any)
	if !ok {
		return false
	}
	if f.fields == nil {
		f.fields = map[string]fastField{}
	}
	for name, s := range m {
		sub, ok := fastNode(s)
		if !ok {
			return false
		}
		f.fields[name] = fastField{sub: sub}
	}
	return true
}

func (f *fastSchema) fastRequired(v any) bool {
	if v == nil {
		return true
	}
	names, ok := v.([]any)
	if !ok || len(names) > 64 {
		return false
	}
	if f.fields == nil {
		f.fields = map[string]fastField{}
	}
	for i, n := range names {
		s, ok := n.(string)
		if !ok {
			return false
		}
		fl := f.fields[s]
		fl.bit = 1 << i
		f.fields[s] = fl
		f.required |= fl.bit
	}
	return true
}

func (f *fastSchema) fastEnum(kw string, v any) bool {
	vals := []any{v}
	if kw == "enum" {
		a, ok := v.([]any)
		if !ok {
			return false
		}
		vals = a
	}
	for _, x := range vals {
		switch n := x.(type) {
		case string, bool, nil:
		case float64:
			if _, ok := exactBound(n); !ok {
				return false
			}
		default:
			return false // objects and arrays: the library compares them
		}
	}
	if f.enum != nil { // both enum and const: intersect by leaving it to the library
		return false
	}
	f.enum = vals
	return true
}

// count accepts a non-negative integer keyword value.
func count(v any) (int, bool) {
	n, ok := v.(float64)
	if !ok || n < 0 || n != math.Trunc(n) || n > math.MaxInt32 {
		return 0, false
	}
	return int(n), true
}

// exactBound accepts an integer bound small enough that float64 comparison
// agrees with the library's exact (big.Rat) comparison.
func exactBound(v any) (float64, bool) {
	n, ok := v.(float64)
	if !ok || n != math.Trunc(n) || math.Abs(n) > 1<<53 {
		return 0, false
	}
	return n, true
}

// valid reports whether b is one JSON value, and nothing else, that matches
// f. False means "not proven valid", not "invalid".
func (f *fastSchema) valid(b []byte) bool {
	s := scanner{b: b}
	if !s.value(f) {
		return false
	}
	s.space()
	return s.i == len(s.b)
}

type scanner struct {
	b []byte
	i int
}

func (s *scanner) space() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// value scans one value and checks it against f (nil: any value).
func (s *scanner) value(f *fastSchema) bool {
	s.space()
	if s.i >= len(s.b) {
		return false
	}
	switch c := s.b[s.i]; {
	case c == '{':
		return f.allows(tObject) && s.object(f)
	case c == '[':
		return f.allows(tArray) && s.array(f)
	case c == '"':
		raw, escaped, ok := s.str()
		return ok && f.allows(tString) && f.checkString(raw, escaped)
	case c == 't':
		return s.literal("true") && f.allows(tBool) && f.inEnum(true)
	case c == 'f':
		return s.literal("false") && f.allows(tBool) && f.inEnum(false)
	case c == 'n':
		return s.literal("null") && f.allows(tNull) && f.inEnum(nil)
	default:
		return s.number(f)
	}
}

func (f *fastSchema) allows(t uint8) bool { return f == nil || f.types == 0 || f.types&t != 0 }

func (f *fastSchema) inEnum(v any) bool {
	if f == nil || f.enum == nil {
		return true
	}
	for _, e := range f.enum {
		if e == v {
			return true
		}
	}
	return false
}

func (s *scanner) literal(lit string) bool {
	if len(s.b)-s.i < len(lit) || string(s.b[s.i:s.i+len(lit)]) != lit {
		return false
	}
	s.i += len(lit)
	return true
}

func (s *scanner) object(f *fastSchema) bool {
	s.i++ // {
	var seen uint64
	s.space()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return f == nil || f.required == 0
	}
	for {
		s.space()
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return false
		}
		key, escaped, ok := s.str()
		if !ok || escaped { // an escaped key: let the library decode it
			return false
		}
		s.space()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return false
		}
		s.i++
		var sub *fastSchema
		if f != nil {
			fl, known := f.fields[string(key)] // no allocation: the compiler borrows key
			if !known && f.closed {
				return false
			}
			sub, seen = fl.sub, seen|fl.bit
		}
		if !s.value(sub) {
			return false
		}
		if done, ok := s.separator('}'); !ok || done {
			return ok && (f == nil || seen&f.required == f.required)
		}
	}
}

// separator consumes the ',' between members or items, or the closing
// bracket (done). ok is false for anything else.
func (s *scanner) separator(closing byte) (done, ok bool) {
	s.space()
	if s.i >= len(s.b) {
		return false, false
	}
	switch s.b[s.i] {
	case ',':
		s.i++
		return false, true
	case closing:
		s.i++
		return true, true
	}
	return false, false
}

func (s *scanner) array(f *fastSchema) bool {
	s.i++ // [
	var items *fastSchema
	if f != nil {
		items = f.items
	}
	n := 0
	s.space()
	if s.i < len(s.b) && s.b[s.i] == ']' {
		s.i++
	} else {
		for done := false; !done; {
			if !s.value(items) {
				return false
			}
			n++
			var ok bool
			if done, ok = s.separator(']'); !ok {
				return false
			}
		}
	}
	return f == nil || (n >= f.minItems && (f.maxItems < 0 || n <= f.maxItems))
}

// str scans a string and returns its raw content (between the quotes) and
// whether it holds escapes.
func (s *scanner) str() (raw []byte, escaped, ok bool) {
	s.i++ // "
	start := s.i
	for s.i < len(s.b) {
		c := s.b[s.i]
		switch {
		case c == '"':
			raw = s.b[start:s.i]
			s.i++
			return raw, escaped, true
		case c == '\\':
			escaped = true
			if s.i+1 >= len(s.b) {
				return nil, false, false
			}
			switch s.b[s.i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.i += 2
			case 'u':
				if s.i+6 > len(s.b) {
					return nil, false, false
				}
				for _, h := range s.b[s.i+2 : s.i+6] {
					if !isHex(h) {
						return nil, false, false
					}
				}
				s.i += 6
			default:
				return nil, false, false
			}
		case c < 0x20:
			return nil, false, false
		default:
			s.i++
		}
	}
	return nil, false, false
}

func isHex(c byte) bool { return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F' }

func (f *fastSchema) checkString(raw []byte, escaped bool) bool {
	if f == nil || (f.minLen < 0 && f.maxLen < 0 && f.enum == nil) {
		return true
	}
	if escaped {
		return false // length and equality need the decoded string: the library's job
	}
	n := utf8.RuneCount(raw)
	if n < f.minLen || (f.maxLen >= 0 && n > f.maxLen) {
		return false
	}
	if f.enum == nil {
		return true
	}
	for _, e := range f.enum {
		if es, ok := e.(string); ok && es == string(raw) {
			return true
		}
	}
	return false
}

func (s *scanner) number(f *fastSchema) bool {
	start := s.i
	if s.i < len(s.b) && s.b[s.i] == '-' {
		s.i++
	}
	switch {
	case s.i < len(s.b) && s.b[s.i] == '0':
		s.i++
	case s.i < len(s.b) && '1' <= s.b[s.i] && s.b[s.i] <= '9':
		s.digits()
	default:
		return false
	}
	if s.i < len(s.b) && s.b[s.i] == '.' {
		s.i++
		if !s.digits() {
			return false
		}
	}
	if s.i < len(s.b) && (s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		s.i++
		if s.i < len(s.b) && (s.b[s.i] == '+' || s.b[s.i] == '-') {
			s.i++
		}
		if !s.digits() {
			return false
		}
	}
	if f == nil || (f.types == 0 && !f.hasMin && !f.hasMax && f.enum == nil) {
		return true
	}
	text := s.b[start:s.i]
	n, err := strconv.ParseFloat(unsafe.String(unsafe.SliceData(text), len(text)), 64)
	if err != nil || math.IsInf(n, 0) {
		return false
	}
	if f.types != 0 && f.types&tNumber == 0 && (f.types&tInteger == 0 || n != math.Trunc(n)) {
		return false
	}
	if f.hasMin && (n < f.minimum || (f.xmin && n == f.minimum)) {
		return false
	}
	if f.hasMax && (n > f.maximum || (f.xmax && n == f.maximum)) {
		return false
	}
	if f.enum == nil {
		return true
	}
	for _, e := range f.enum {
		if en, ok := e.(float64); ok && en == n {
			return true
		}
	}
	return false
}

func (s *scanner) digits() bool {
	start := s.i
	for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
		s.i++
	}
	return s.i > start
}
