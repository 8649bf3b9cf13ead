package contract

import (
	"encoding/json"
	"strconv"
	"time"
	"unicode/utf8"
)

// HeaderHistory is the attempt history of a retry copy or a dead letter: a
// JSON array of the last MaxHistory failed attempts, oldest first, each
// {"intent": n, "en": "<time>", "error": "<text>"} with the time in the one
// encoding (FormatTime) and the error cut to MaxHistoryError bytes.
const HeaderHistory = "historial_intents"

// Bounds of HeaderHistory, so that a message failing many times (or a
// forged copy) cannot grow its copies' headers without end.
const (
	MaxHistory      = 10  // attempts kept: the last ones
	MaxHistoryError = 120 // bytes of one attempt's error text
)

// FailedAttempt is one failed attempt of a message, as HeaderHistory lists it.
type FailedAttempt struct {
	N     int       // the attempt (1 is the first delivery)
	At    time.Time // when it failed; zero when its time did not parse
	Error string    // its error (ultim_error), at most MaxHistoryError bytes
}

type wireAttempt struct {
	N     int    `json:"intent"`
	At    string `json:"en"`
	Error string `json:"error"`
}

// ParseHistory reads a HeaderHistory value. It never fails: a value that is
// not a JSON array of attempts reads as none, an entry's time that does not
// parse as zero; it keeps at most the last MaxHistory entries and cuts each
// error to MaxHistoryError bytes, as a copy's headers are not trusted.
func ParseHistory(s string) []FailedAttempt {
	if s == "" {
		return nil
	}
	var w []wireAttempt
	if err := json.Unmarshal([]byte(s), &w); err != nil {
		return nil
	}
	if len(w) > MaxHistory {
		w = w[len(w)-MaxHistory:]
	}
	out := make([]FailedAttempt, 0, len(w))
	for _, a := range w {
		at, _ := ParseTime(a.At)
		out = append(out, FailedAttempt{N: a.N, At: at, Error: cut(a.Error, MaxHistoryError)})
	}
	return out
}

// FormatHistory renders h as a HeaderHistory value: its last MaxHistory
// attempts, each error cut to MaxHistoryError bytes.
func FormatHistory(h []FailedAttempt) string {
	if len(h) > MaxHistory {
		h = h[len(h)-MaxHistory:]
	}
	w := make([]wireAttempt, len(h))
	for i, a := range h {
		w[i] = wireAttempt{N: a.N, Error: cut(a.Error, MaxHistoryError)}
		if !a.At.IsZero() {
			w[i].At = FormatTime(a.At)
		}
	}
	b, _ := json.Marshal(w) // strings and ints only: cannot fail
	return string(b)
}

// cut truncates s to at most n bytes on a rune boundary.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// Failure is what a source knows of a failed delivery when it copies it to
// a retry destination or a dead-letter one (CopyHeaders).
type Failure struct {
	Dead      bool      // a dead letter (else a retry copy)
	Attempt   int       // the attempt that failed (intents)
	LastError string    // its error (ultim_error), ≤ 200 bytes
	Reason    string    // a dead letter's motiu
	NotBefore time.Time // a retry copy's no_abans
	// Where and when the delivery was read: the domain topic (or the work
	// queue), its partition (or shard), its offset (-1 on RabbitMQ) and its
	// broker timestamp (zero when unknown). A retry copy (Attempt > 1) keeps
	// the first failure's values instead, read from Prior.
	Origin    string
	Partition int32
	Offset    int64
	Timestamp time.Time
	Group     string    // grup_consumidor: the consumer group, or the work queue
	Now       time.Time // the time of the failure
	// Prior returns a header of the failed delivery, "" when it has none
	// (a time header as text, in any encoding ParseTime reads).
	Prior func(key string) string
}

// copyHeaderNames are the headers CopyHeaders writes, in its order.
var copyHeaderNames = []string{HeaderAttempts, HeaderNotBefore, HeaderLastError, HeaderReason,
	HeaderOriginalTopic, HeaderOriginalPartition, HeaderOriginalOffset, HeaderFirstFailure,
	HeaderOriginalTime, HeaderGroup, HeaderDeadAt, HeaderHistory}

// IsCopyHeader reports whether key is one of the headers CopyHeaders
// writes: a source drops them from the original before it adds the copy's,
// and a replay strips them so the message starts a clean history.
func IsCopyHeader(key string) bool {
	for _, k := range copyHeaderNames {
		if k == key {
			return true
		}
	}
	return false
}

// KV is one header of a copy.
type KV struct{ Key, Value string }

// CopyHeaders returns the headers of the retry copy or dead letter of f, on
// either broker, in a fixed order: intents, no_abans (a retry) or motiu and
// mort_en (a dead letter), ultim_error, the first failure's position
// (topic_original, particio_original, offset_original), primera_fallada,
// data_original (when known), grup_consumidor and historial_intents.
//
// On a copy of a copy (Attempt > 1) the first failure's position and times
// are kept from Prior; a kept time is rewritten in the one encoding, and one
// that does not parse is replaced by this failure's (primera_fallada: Now;
// data_original: Timestamp, or left out when that is unknown). A first
// delivery's headers are not read: it starts a clean history. The history
// is Prior's (on a copy of a copy) followed by this attempt.
func CopyHeaders(f Failure) []KV {
	prior := f.Prior
	if prior == nil || f.Attempt <= 1 {
		prior = func(string) string { return "" }
	}
	v := map[string]string{
		HeaderAttempts:          strconv.Itoa(f.Attempt),
		HeaderLastError:         f.LastError,
		HeaderOriginalTopic:     f.Origin,
		HeaderOriginalPartition: strconv.Itoa(int(f.Partition)),
		HeaderOriginalOffset:    strconv.FormatInt(f.Offset, 10),
		HeaderFirstFailure:      FormatTime(f.Now),
		HeaderGroup:             f.Group,
	}
	if f.Dead {
		v[HeaderReason] = f.Reason
		v[HeaderDeadAt] = FormatTime(f.Now)
	} else {
		v[HeaderNotBefore] = FormatTime(f.NotBefore)
	}
	if !f.Timestamp.IsZero() {
		v[HeaderOriginalTime] = FormatTime(f.Timestamp)
	}
	for _, k := range []string{HeaderOriginalTopic, HeaderOriginalPartition, HeaderOriginalOffset} {
		if p := prior(k); p != "" {
			v[k] = p
		}
	}
	for _, k := range []string{HeaderFirstFailure, HeaderOriginalTime} {
		if t, err := ParseTime(prior(k)); err == nil {
			v[k] = FormatTime(t)
		}
	}
	h := append(ParseHistory(prior(HeaderHistory)), FailedAttempt{N: f.Attempt, At: f.Now, Error: f.LastError})
	v[HeaderHistory] = FormatHistory(h)
	out := make([]KV, 0, len(v))
	for _, k := range copyHeaderNames {
		if x, ok := v[k]; ok {
			out = append(out, KV{k, x})
		}
	}
	return out
}
