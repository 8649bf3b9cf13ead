package envelope

import (
	"bytes"
	"encoding/json"
	"strings"
	"unicode/utf8"
)

// topLevelMembers counts the members of the JSON object b, which
// encoding/json has already accepted as valid, without decoding them. A count
// above the number of distinct names means the object repeats a member:
// readers disagree on which copy counts (encoding/json keeps the last, others
// the first or refuse), so Decode refuses it.
func topLevelMembers(b []byte) int {
	i := skipWS(b, 0)
	if i >= len(b) || b[i] != '{' {
		return 0
	}
	i++
	n := 0
	for {
		i = skipWS(b, i)
		if i >= len(b) || b[i] == '}' {
			return n
		}
		if b[i] == ',' {
			i++
			continue
		}
		i = skipString(b, i) // the member's name
		n++
		i = skipWS(b, i)
		if i < len(b) && b[i] == ':' {
			i++
		}
		i = skipValue(b, skipWS(b, i))
	}
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r' || b[i] == '\n') {
		i++
	}
	return i
}

// skipString returns the index after the string starting at b[i] ('"').
func skipString(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return i
}

// skipValue returns the index after the value starting at b[i].
func skipValue(b []byte, i int) int {
	depth := 0
	for i < len(b) {
		switch c := b[i]; {
		case c == '"':
			i = skipString(b, i)
			if depth == 0 {
				return i
			}
			continue
		case c == '{' || c == '[':
			depth++
		case c == '}' || c == ']':
			if depth == 0 {
				return i
			}
			depth--
			if depth == 0 {
				return i + 1
			}
		case depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\r' || c == '\n'):
			return i
		}
		i++
	}
	return i
}

// replaced reports whether decoding the JSON string raw into s replaced
// something with U+FFFD: invalid UTF-8 or an escaped lone surrogate, which
// encoding/json turns into U+FFFD silently and other readers refuse or keep.
func replaced(raw json.RawMessage, s string) bool {
	if !strings.ContainsRune(s, utf8.RuneError) {
		return false
	}
	if !utf8.Valid(raw) {
		return true
	}
	// A U+FFFD written as such, or escaped, is the writer's own.
	lit := bytes.Count(raw, []byte("\uFFFD")) + bytes.Count(bytes.ToLower(raw), []byte(`\ufffd`))
	return strings.Count(s, "\uFFFD") > lit
}
