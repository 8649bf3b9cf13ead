// Package envelope is the versioned event envelope of CONTRACT.md:
//
//	{"id_esdeveniment": "<uuid>", "tipus": "comanda.creada", "versio": 2,
//	 "data_ms": 1789000000000, "origen": "comandes", "dades": {...}}
//
// Decode is strict about what the contract requires and tolerant of everything
// else: unknown members are kept (Extra) and written back by Encode, so a
// consumer or a DLQ replay never drops a field a newer producer added.
// Every decoding failure is an outcome.Permanent error whose message names the
// problem, because a malformed message will not heal by being retried.
package envelope

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
)

// DefaultMaxBytes is the default size limit of an encoded envelope (1 MiB).
const DefaultMaxBytes = 1 << 20

// MaxIDBytes bounds id_esdeveniment. The id is an idempotency key stored in a
// btree-indexed TEXT column: an unbounded or NUL-carrying id would be refused
// by PostgreSQL at every attempt instead of being dead-lettered once.
const MaxIDBytes = 256

// Member names on the wire.
const (
	fieldID      = "id_esdeveniment"
	fieldType    = "tipus"
	fieldVersion = "versio"
	fieldTimeMS  = "data_ms"
	fieldOrigin  = "origen"
	fieldData    = "dades"
)

// Envelope is one event.
type Envelope struct {
	ID      string          // id_esdeveniment: the idempotency key, stable across retries
	Type    string          // tipus, e.g. "comanda.creada"
	Version int             // versio, a positive integer
	TimeMS  int64           // data_ms: milliseconds since the Unix epoch
	Origin  string          // origen: the publishing service
	Data    json.RawMessage // dades: the payload, a JSON object
	// Extra holds members the contract does not name. They are kept so that
	// re-encoding is lossless, and otherwise ignored.
	Extra map[string]json.RawMessage
}

// ErrDecode is the sentinel every decoding error wraps (errors.Is).
var ErrDecode = errors.New("envelope")

// DecodeError is a decoding failure. It is permanent (see outcome) and its
// message names the member and what is wrong with it.
type DecodeError struct {
	Field  string // the offending member, or "" for the whole value
	Reason string
}

func (e *DecodeError) Error() string {
	if e.Field == "" {
		return "envelope: " + e.Reason
	}
	return "envelope: " + e.Field + ": " + e.Reason
}

// Is makes errors.Is(err, ErrDecode) true.
func (e *DecodeError) Is(target error) bool { return target == ErrDecode }

// Decoder decodes envelopes with a size limit.
type Decoder struct {
	// MaxBytes is the largest accepted encoded envelope. Default DefaultMaxBytes.
	MaxBytes int
}

// Decode decodes b with the default limit. See Decoder.Decode.
func Decode(b []byte) (*Envelope, error) { return Decoder{}.Decode(b) }

// Decode parses one envelope. It returns a *DecodeError (wrapped so that
// outcome.IsPermanent is true) for: a value over MaxBytes, bad JSON, a value that
// is not an object, a missing or empty id_esdeveniment or tipus, a versio that
// is not a positive integer, a data_ms that is not an integer, an origen that is
// not a string, or dades missing or not an object; a member that appears twice
// (readers disagree on which copy counts); and invalid UTF-8 or a lone
// surrogate escape in id_esdeveniment, tipus or origen (encoding/json would
// silently replace it with U+FFFD).
func (d Decoder) Decode(b []byte) (*Envelope, error) {
	limit := d.MaxBytes
	if limit <= 0 {
		limit = DefaultMaxBytes
	}
	if len(b) > limit {
		return nil, permanent("", fmt.Sprintf("%d bytes, over the limit of %d", len(b), limit))
	}
	var members map[string]json.RawMessage
	if err := json.Unmarshal(b, &members); err != nil {
		var ute *json.UnmarshalTypeError
		if errors.As(err, &ute) {
			return nil, permanent("", "not a JSON object")
		}
		return nil, permanent("", "malformed JSON: "+err.Error())
	}
	if members == nil {
		return nil, permanent("", "not a JSON object")
	}
	if topLevelMembers(b) != len(members) {
		return nil, permanent("", "a member appears twice: readers would disagree on its value")
	}
	e := &Envelope{}
	var err error
	if e.ID, err = requiredString(members, fieldID); err != nil {
		return nil, err
	}
	if err := CheckKey(e.ID); err != nil {
		return nil, permanent(fieldID, err.Error())
	}
	if e.Type, err = requiredString(members, fieldType); err != nil {
		return nil, err
	}
	raw, ok := members[fieldVersion]
	if !ok {
		return nil, permanent(fieldVersion, "missing")
	}
	v, err := strconv.ParseInt(string(raw), 10, 32)
	if err != nil || v <= 0 {
		return nil, permanent(fieldVersion, fmt.Sprintf("must be a positive integer, got %s", clip(raw)))
	}
	e.Version = int(v)
	if raw, ok := members[fieldTimeMS]; ok && string(raw) != "null" {
		ms, err := parseInt64(raw)
		if err != nil {
			return nil, permanent(fieldTimeMS, fmt.Sprintf("must be an integer (ms since epoch), got %s", clip(raw)))
		}
		e.TimeMS = ms
	}
	if raw, ok := members[fieldOrigin]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &e.Origin); err != nil {
			return nil, permanent(fieldOrigin, fmt.Sprintf("must be a string, got %s", clip(raw)))
		}
		if replaced(raw, e.Origin) {
			return nil, permanent(fieldOrigin, "invalid UTF-8 or a lone surrogate escape")
		}
	}
	raw, ok = members[fieldData]
	if !ok {
		return nil, permanent(fieldData, "missing")
	}
	if t := bytes.TrimLeft(raw, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return nil, permanent(fieldData, fmt.Sprintf("must be a JSON object, got %s", clip(raw)))
	}
	e.Data = raw
	for _, k := range []string{fieldID, fieldType, fieldVersion, fieldTimeMS, fieldOrigin, fieldData} {
		delete(members, k)
	}
	if len(members) > 0 {
		e.Extra = members
	}
	return e, nil
}

// CheckKey reports why s cannot be an idempotency key: longer than MaxIDBytes
// or holding a NUL byte (PostgreSQL TEXT refuses it). nil means it can.
func CheckKey(s string) error {
	if len(s) > MaxIDBytes {
		return fmt.Errorf("%d bytes, over the limit of %d", len(s), MaxIDBytes)
	}
	if strings.IndexByte(s, 0) >= 0 {
		return errors.New("contains a NUL byte")
	}
	return nil
}

// parseInt64 accepts an integer written plainly or as a float with no fraction
// (1.789e12), as some encoders write large numbers.
func parseInt64(raw json.RawMessage) (int64, error) {
	if n, err := strconv.ParseInt(string(raw), 10, 64); err == nil {
		return n, nil
	}
	f, err := strconv.ParseFloat(string(raw), 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return 0, errors.New("not an integer")
	}
	return int64(f), nil
}

func requiredString(m map[string]json.RawMessage, field string) (string, error) {
	raw, ok := m[field]
	if !ok {
		return "", permanent(field, "missing")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", permanent(field, fmt.Sprintf("must be a string, got %s", clip(raw)))
	}
	if replaced(raw, s) {
		return "", permanent(field, "invalid UTF-8 or a lone surrogate escape")
	}
	if s == "" {
		return "", permanent(field, "empty")
	}
	return s, nil
}

func clip(raw json.RawMessage) string {
	const n = 40
	if len(raw) <= n {
		return string(raw)
	}
	return string(raw[:n]) + "…"
}

// Encode writes the envelope as JSON: the contract's members in contract order,
// then Extra members sorted by name. It refuses (a *DecodeError) what Decode
// would refuse or read differently: an empty or unstorable id (CheckKey), an
// empty tipus, a versio outside 1..MaxInt32, dades that is not an object, or a
// contract member in Extra.
func (e *Envelope) Encode() ([]byte, error) {
	if e.ID == "" {
		return nil, &DecodeError{Field: fieldID, Reason: "empty"}
	}
	if err := CheckKey(e.ID); err != nil {
		return nil, &DecodeError{Field: fieldID, Reason: err.Error()}
	}
	if e.Type == "" {
		return nil, &DecodeError{Field: fieldType, Reason: "empty"}
	}
	if e.Version <= 0 || e.Version > math.MaxInt32 {
		return nil, &DecodeError{Field: fieldVersion, Reason: "must be a positive 32-bit integer"}
	}
	data := e.Data
	if len(data) == 0 {
		data = json.RawMessage("{}")
	}
	if t := bytes.TrimLeft(data, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return nil, &DecodeError{Field: fieldData, Reason: fmt.Sprintf("must be a JSON object, got %s", clip(data))}
	}
	for k := range e.Extra {
		switch k {
		case fieldID, fieldType, fieldVersion, fieldTimeMS, fieldOrigin, fieldData:
			// Written after the contract's own member, it would win on decode.
			return nil, &DecodeError{Field: k, Reason: "in Extra: a contract member is set through its field"}
		}
	}
	var buf bytes.Buffer
	buf.Grow(96 + len(e.ID) + len(e.Type) + len(e.Origin) + len(data))
	buf.WriteString(`{"id_esdeveniment":`)
	writeString(&buf, e.ID)
	buf.WriteString(`,"tipus":`)
	writeString(&buf, e.Type)
	buf.WriteString(`,"versio":`)
	buf.WriteString(strconv.Itoa(e.Version))
	buf.WriteString(`,"data_ms":`)
	buf.WriteString(strconv.FormatInt(e.TimeMS, 10))
	buf.WriteString(`,"origen":`)
	writeString(&buf, e.Origin)
	buf.WriteString(`,"dades":`)
	buf.Write(data)
	if len(e.Extra) > 0 {
		keys := make([]string, 0, len(e.Extra))
		for k := range e.Extra {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			buf.WriteByte(',')
			writeString(&buf, k)
			buf.WriteByte(':')
			buf.Write(e.Extra[k])
		}
	}
	buf.WriteByte('}')
	return buf.Bytes(), nil
}

// MarshalJSON implements json.Marshaler with Encode.
func (e *Envelope) MarshalJSON() ([]byte, error) { return e.Encode() }

// UnmarshalJSON implements json.Unmarshaler with Decode (default limit).
func (e *Envelope) UnmarshalJSON(b []byte) error {
	d, err := Decode(b)
	if err != nil {
		return err
	}
	*e = *d
	return nil
}

func writeString(buf *bytes.Buffer, s string) {
	if isPlain(s) {
		buf.WriteByte('"')
		buf.WriteString(s)
		buf.WriteByte('"')
		return
	}
	b, _ := json.Marshal(s)
	buf.Write(b)
}

// isPlain reports whether s needs no JSON escaping.
func isPlain(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c == '"' || c == '\\' || c >= 0x7f || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
}

// DataAs decodes dades into v. A mismatch is a permanent error naming the
// event type, because the payload will not change on a retry.
func (e *Envelope) DataAs(v any) error {
	if err := json.Unmarshal(e.Data, v); err != nil {
		return permanent(fieldData, fmt.Sprintf("%s v%d: %v", e.Type, e.Version, err))
	}
	return nil
}
