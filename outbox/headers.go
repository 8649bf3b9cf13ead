package outbox

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/transport"
)

// Limits of the capcaleres column (an event's extra headers).
const (
	// MaxHeadersBytes bounds the headers of one event: the sum of the
	// lengths of every name and value. W3C trace context needs well under
	// 1 KiB (traceparent is 55 bytes, tracestate at most 512 by convention).
	MaxHeadersBytes = 8 << 10
	// MaxHeaderNameBytes bounds one header name: an AMQP table key is a
	// short string of at most 255 bytes.
	MaxHeaderNameBytes = 255
)

// reserved are the header names km0 itself writes or reads with a meaning
// (CONTRACT.md); an event's extra headers may not carry them, so a caller's
// header can never pass for the contract's. Compared case-insensitively.
var reserved = []string{
	contract.HeaderType, contract.HeaderEventID, contract.HeaderCorrelator,
	contract.HeaderAttempts, contract.HeaderNotBefore, contract.HeaderLastError, contract.HeaderReason,
	contract.HeaderOriginalTopic, contract.HeaderOriginalPartition, contract.HeaderOriginalOffset,
	contract.HeaderFirstFailure, contract.HeaderGroup, contract.HeaderOriginalTime,
	contract.HeaderDeadAt, contract.HeaderDeadline,
	// Written by km0's transports and patterns (spelled here: those
	// packages import this one's dependents).
	"clau", "cua_origen", // transport/amqp HeaderKey, HeaderOriginQueue
	"respondre_a", "id_peticio", "resultat", // requestreply
	"reproduida_de", // dlq HeaderReplayedFrom
}

// isReserved reports whether name is a header an event may not set: one of the
// contract's (tipus, id_esdeveniment, correlacio, intents, no_abans,
// ultim_error, motiu, the *_original and time headers), one km0's transports
// and patterns write (clau, cua_origen, respondre_a, id_peticio, resultat,
// reproduida_de), or a name starting with "km0" or "x-" (RabbitMQ's own, such
// as x-death), compared case-insensitively.
func isReserved(name string) bool {
	if len(name) >= 2 && strings.EqualFold(name[:2], "x-") || len(name) >= 3 && strings.EqualFold(name[:3], "km0") {
		return true
	}
	for _, r := range reserved {
		if strings.EqualFold(name, r) {
			return true
		}
	}
	return false
}

// checkHeaders returns an error wrapping ErrInvalid, naming the header, when
// h cannot be stored as an event's capcaleres: an empty or reserved name
// (Reserved), a name over MaxHeaderNameBytes, a name or value that is not
// valid UTF-8 or holds a NUL (PostgreSQL's JSONB refuses \u0000), or over
// MaxHeadersBytes in all. nil and empty maps are valid.
func checkHeaders(h map[string]string) error {
	total := 0
	for k, v := range h {
		if err := checkHeader(k, v); err != nil {
			return err
		}
		total += len(k) + len(v)
	}
	return checkTotal(total)
}

// checkHeader is checkHeaders for one entry, without the total.
func checkHeader(k, v string) error {
	switch {
	case k == "":
		return fmt.Errorf("%w: header with an empty name", ErrInvalid)
	case isReserved(k):
		return fmt.Errorf("%w: header %q is reserved by km0", ErrInvalid, k)
	case len(k) > MaxHeaderNameBytes:
		return fmt.Errorf("%w: header name %.40q… is %d bytes, over the limit of %d", ErrInvalid, k, len(k), MaxHeaderNameBytes)
	case !utf8.ValidString(k) || strings.IndexByte(k, 0) >= 0:
		return fmt.Errorf("%w: header name %q is not valid UTF-8 without NUL", ErrInvalid, k)
	case !utf8.ValidString(v) || strings.IndexByte(v, 0) >= 0:
		return fmt.Errorf("%w: header %q: value is not valid UTF-8 without NUL", ErrInvalid, k)
	}
	return nil
}

// checkTotal refuses headers of total bytes (names and values) over
// MaxHeadersBytes.
func checkTotal(total int) error {
	if total > MaxHeadersBytes {
		return fmt.Errorf("%w: headers are %d bytes, over the limit of %d", ErrInvalid, total, MaxHeadersBytes)
	}
	return nil
}

// DecodeHeaders reads a capcaleres column as stored (JSON text). NULL (nil
// or empty raw) and JSON null give (nil, nil). Otherwise it returns the
// entries Enqueue would accept and, if it dropped anything, an error
// wrapping ErrInvalid saying what: the value is not a JSON object, an entry
// is not a string (null, a number, a bool, an object or an array: dropped,
// never published as ""), a name is reserved, or the whole is over MaxHeadersBytes
// (then every entry is dropped). A relay logs that error and publishes the
// event with the entries returned: bad metadata never holds back an event.
func DecodeHeaders(raw []byte) (map[string]string, error) { return decodeHeaders(raw, true) }

// decodeHeaders is DecodeHeaders, trying scanHeaders first when fast is set
// (the tests compare both paths).
func decodeHeaders(raw []byte, fast bool) (map[string]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	h, errs, total := map[string]string{}, []error(nil), 0
	// keep takes one entry (names are distinct on both paths: scanHeaders
	// leaves duplicates to encoding/json, whose map keeps the last). An
	// entry over the total limit on its own is dropped alone, so the others
	// (a traceparent) are still published.
	keep := func(k, v string) {
		err := checkHeader(k, v)
		if err == nil {
			err = checkTotal(len(k) + len(v))
		}
		if err != nil {
			errs = append(errs, err)
			return
		}
		h[k] = v
		total += len(k) + len(v)
	}
	if !fast || !scanHeaders(raw, keep) {
		clear(h)
		errs, total = nil, 0
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(raw, &fields); err != nil {
			return nil, fmt.Errorf("%w: capcaleres is not a JSON object of strings: %v", ErrInvalid, err)
		}
		if fields == nil {
			return nil, nil
		}
		for k, rv := range fields {
			var v string
			// json.Unmarshal reads null into a string as "" without an
			// error: only a JSON string is a header value (CONTRACT.md), so
			// a null is dropped like a number, a bool or an object.
			if len(rv) == 0 || rv[0] != '"' || json.Unmarshal(rv, &v) != nil {
				errs = append(errs, fmt.Errorf("%w: capcaleres %q is not a string", ErrInvalid, k))
				continue
			}
			keep(k, v)
		}
	}
	if err := checkTotal(total); err != nil {
		return nil, errors.Join(append(errs, err)...)
	}
	if len(h) == 0 {
		h = nil
	}
	return h, errors.Join(errs...)
}

// scanHeaders is DecodeHeaders' fast path: a JSON object whose names and
// values are all strings without escapes (what json.Marshal writes for
// ordinary headers, a traceparent among them, and PostgreSQL's jsonb text
// with its spaces), names all different, read
// without reflection; keep gets each entry in order. It reports false,
// having called keep for nothing, for anything else, which encoding/json
// then reads.
func scanHeaders(raw []byte, keep func(k, v string)) bool {
	b, ok := bytes.CutPrefix(bytes.TrimLeft(raw, jsonSpace), []byte("{"))
	if !ok {
		return false
	}
	type entry struct{ k, v []byte }
	var entries [8]entry
	es := entries[:0]
	for b = bytes.TrimLeft(b, jsonSpace); len(b) > 0 && b[0] != '}'; b = bytes.TrimLeft(b, jsonSpace) {
		if len(es) > 0 {
			if b, ok = bytes.CutPrefix(b, []byte(",")); !ok {
				return false
			}
		}
		var k, v []byte
		if k, b, ok = scanString(bytes.TrimLeft(b, jsonSpace)); !ok {
			return false
		}
		if b, ok = bytes.CutPrefix(bytes.TrimLeft(b, jsonSpace), []byte(":")); !ok {
			return false
		}
		if v, b, ok = scanString(bytes.TrimLeft(b, jsonSpace)); !ok {
			return false
		}
		for _, e := range es {
			if string(e.k) == string(k) {
				return false // duplicate names: encoding/json's path decides
			}
		}
		es = append(es, entry{k, v})
	}
	if len(b) == 0 || len(bytes.TrimLeft(b[1:], jsonSpace)) != 0 {
		return false
	}
	for _, e := range es {
		keep(string(e.k), string(e.v))
	}
	return true
}

// AppendHeaders appends the entries of h to hs as message headers, in name
// order, skipping reserved names and names hs already holds: a row's
// capcaleres never replace the contract's headers. It is how both relays turn
// Row.Headers into a record's headers.
func AppendHeaders(hs []transport.Header, h map[string]string) []transport.Header {
	if len(h) == 0 {
		return hs
	}
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if k == "" || isReserved(k) || slices.ContainsFunc(hs, func(x transport.Header) bool { return x.Key == k }) {
			continue
		}
		hs = append(hs, transport.Header{Key: k, Value: h[k]})
	}
	return hs
}

// encodeHeaders merges the trace context of the call (traced) with the
// event's own headers and returns the capcaleres to store, or nil for NULL.
// The event's headers must pass checkHeaders (the caller's error); a
// propagated field is kept only if the event does not set it and it fits
// (trace context never fails a business write).
func encodeHeaders(traced, own map[string]string) (*string, error) {
	if len(traced) == 0 && len(own) == 0 {
		return nil, nil
	}
	if err := checkHeaders(own); err != nil {
		return nil, err
	}
	merged := make(map[string]string, len(traced)+len(own))
	total := 0
	for k, v := range own {
		merged[k] = v
		total += len(k) + len(v)
	}
	for k, v := range traced {
		if _, set := merged[k]; set || checkHeaders(map[string]string{k: v}) != nil || total+len(k)+len(v) > MaxHeadersBytes {
			continue
		}
		merged[k] = v
		total += len(k) + len(v)
	}
	if len(merged) == 0 {
		return nil, nil
	}
	b, err := json.Marshal(merged)
	if err != nil {
		return nil, fmt.Errorf("outbox: encode capcaleres: %w", err)
	}
	s := string(b)
	return &s, nil
}
