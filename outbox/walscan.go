package outbox

import (
	"bytes"
	"encoding/json"
	"unicode/utf8"
)

// scanWAL reads content laid out exactly as encodeWAL writes it: its
// members in its order, no white space but around and inside carrega and
// capcaleres, strings without escapes, integers without sign, fraction or
// exponent. It is DecodeWAL's fast path, for the CDC relay's reader decodes
// every event of the stream on one goroutine; encoding/json with reflection
// costs about three times as much (BenchmarkDecodeWAL). ok is false
// for any other layout, which DecodeWAL then reads with encoding/json:
// another writer's member order, escapes, or content that is not valid JSON
// (encoding/json then says what is wrong). On ok, c holds copies: nothing
// refers into content.
//
// carrega and capcaleres are JSON objects of any shape: skipValue finds
// where each ends, and json.Valid checks it, so a value the scan got wrong
// cannot pass.
func scanWAL(content []byte) (c walContent, ok bool) {
	b := content
	var s []byte
	if b, ok = bytes.CutPrefix(b, []byte(`{"v":`)); !ok {
		return c, false
	}
	if c.V, b, ok = scanInt(b); !ok {
		return c, false
	}
	for _, m := range [...]struct {
		name string
		dst  *string
	}{{`,"id":`, &c.ID}, {`,"agregat":`, &c.Aggregate}, {`,"agregat_id":`, &c.AggID}, {`,"tipus":`, &c.Type}} {
		if b, ok = bytes.CutPrefix(b, []byte(m.name)); !ok {
			return c, false
		}
		if s, b, ok = scanString(b); !ok {
			return c, false
		}
		*m.dst = string(s)
	}
	if b, ok = bytes.CutPrefix(b, []byte(`,"versio":`)); !ok {
		return c, false
	}
	if c.Version, b, ok = scanInt(b); !ok {
		return c, false
	}
	if b, ok = bytes.CutPrefix(b, []byte(`,"creat_en":`)); !ok {
		return c, false
	}
	if s, b, ok = scanString(b); !ok {
		return c, false
	}
	c.CreatedAt = string(s)
	if b, ok = bytes.CutPrefix(b, []byte(`,"carrega":`)); !ok {
		return c, false
	}
	if c.Payload, b, ok = scanValue(b); !ok {
		return c, false
	}
	if rest, has := bytes.CutPrefix(b, []byte(`,"capcaleres":`)); has {
		if c.Headers, b, ok = scanValue(rest); !ok {
			return c, false
		}
	}
	if len(b) != 1 || b[0] != '}' {
		return c, false
	}
	return c, true
}

// scanInt reads a JSON integer of up to 9 digits, without sign (versio and
// v are positive; anything else takes encoding/json's path).
func scanInt(b []byte) (int, []byte, bool) {
	n, i := 0, 0
	for ; i < len(b) && i < 10 && b[i] >= '0' && b[i] <= '9'; i++ {
		n = n*10 + int(b[i]-'0')
	}
	if i == 0 || i == 10 || (b[0] == '0' && i > 1) {
		return 0, b, false
	}
	return n, b[i:], true
}

// scanString reads a JSON string without escapes or control characters,
// in valid UTF-8 (what encoding/json would return unchanged); s refers into
// b.
func scanString(b []byte) (s, rest []byte, ok bool) {
	if len(b) == 0 || b[0] != '"' {
		return nil, b, false
	}
	ascii := true
	for i := 1; i < len(b); i++ {
		switch c := b[i]; {
		case c == '"':
			if !ascii && !utf8.Valid(b[1:i]) {
				return nil, b, false
			}
			return b[1:i], b[i+1:], true
		case c == '\\' || c < 0x20:
			return nil, b, false
		case c >= utf8.RuneSelf:
			ascii = false
		}
	}
	return nil, b, false
}

// scanValue reads one JSON object or array and returns a copy of it once json.Valid
// accepts it.
func scanValue(b []byte) (v json.RawMessage, rest []byte, ok bool) {
	b = bytes.TrimLeft(b, jsonSpace) // a payload is written as given: white space around it stays
	n := skipValue(b)
	if n <= 0 || !json.Valid(b[:n]) {
		return nil, b, false
	}
	return bytes.Clone(b[:n]), bytes.TrimLeft(b[n:], jsonSpace), true
}

// jsonSpace is JSON's white space, the cutset of bytes.TrimLeft.
const jsonSpace = " \t\n\r"

// skipValue returns the length of the JSON object or array at the start
// of b, or 0 when it cannot tell (anything else, or unbalanced): brackets
// outside strings counted back to depth 0, strings skipped with their
// escapes. It does not validate (scanValue's json.Valid does); on valid
// JSON it is exact.
func skipValue(b []byte) int {
	if len(b) == 0 || (b[0] != '{' && b[0] != '[') {
		return 0
	}
	depth := 0
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '"':
			for i++; i < len(b) && b[i] != '"'; i++ {
				if b[i] == '\\' {
					i++
				}
			}
			if i >= len(b) {
				return 0
			}
		case '{', '[':
			depth++
		case '}', ']':
			if depth--; depth == 0 {
				return i + 1
			}
		}
	}
	return 0
}
