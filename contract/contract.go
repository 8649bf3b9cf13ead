// Package contract holds the wire vocabulary that the consume pipeline
// (package consumer), its broker sources (transport/kafka, transport/amqp),
// the relays and package dlq share: the names of the headers of retry and
// dead-letter copies, the one encoding of their time headers, the rules by
// which a consumer reads a retry copy's headers without trusting them
// further than its own configuration, the motiu classes, the idempotency
// key, the derived topic and queue names, and the database interface every
// package takes (DBTX). It imports nothing else of km0, so any package may
// use it.
//
// Every time header, on either broker, is unix seconds as a decimal string
// with six decimals, written by FormatTime and read by ParseTime.
package contract

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Header names (CONTRACT.md).
const (
	HeaderType       = "tipus"           // the envelope's tipus
	HeaderEventID    = "id_esdeveniment" // the envelope's id_esdeveniment
	HeaderCorrelator = "correlacio"      // shared id of a dual-published pair
	HeaderAttempts   = "intents"         // attempts so far (retry and DLQ copies)
	HeaderNotBefore  = "no_abans"        // time: earliest next attempt (retry copies)
	HeaderLastError  = "ultim_error"     // the last attempt's error, ≤ 200 bytes
	HeaderReason     = "motiu"           // a dead letter's reason, ≤ 200 bytes

	// The first failure's position and time, kept by every later copy.
	HeaderOriginalTopic     = "topic_original"    // the domain topic
	HeaderOriginalPartition = "particio_original" // its partition
	HeaderOriginalOffset    = "offset_original"   // its offset
	HeaderFirstFailure      = "primera_fallada"   // time of the first failure
	HeaderGroup             = "grup_consumidor"   // the group whose handler failed
	// HeaderOriginalTime is the time of the source record (its broker
	// timestamp): for an event without data_ms, the earliest moment another
	// group can have recorded its key, which bounds a safe replay.
	HeaderOriginalTime = "data_original"

	// HeaderDeadAt is when a consumer dead-lettered a message itself (a
	// copy it published to the DLQ), on either broker.
	HeaderDeadAt = "mort_en"
	// HeaderDeadline is a request's absolute deadline (request/reply).
	HeaderDeadline = "no_despres"
	// HeaderPartition is, on RabbitMQ, the shard of a domain event: FNV-1a
	// (32 bit) of its agregat_id modulo the consumers' shard count, as a
	// decimal string. The routing key stays the topic name; a consumer that
	// keeps order per key routes on this header to its single-active-consumer
	// shard queues (PartitionsExchangeName).
	HeaderPartition = "particio"
)

// millisThreshold separates the two readings of a time header: a value above
// it is unix milliseconds (copies written by older RabbitMQ consumers carry
// primera_fallada and mort_en so; 1e11 seconds is in the year 5138), a value
// at or below it unix seconds.
const millisThreshold = 1e11

// maxMillis bounds a value read as milliseconds: above it, the value names
// no time ParseTime accepts (beyond millisThreshold seconds).
const maxMillis = millisThreshold * 1000

// ErrNotTime is wrapped by ParseTime's errors.
var ErrNotTime = errors.New("contract: not a unix time")

// FormatTime renders t as a time header: unix seconds with six decimals
// (microseconds), e.g. "1789000000.250000". Times before 1970 render with a
// minus sign; they name no event and ParseTime refuses them.
func FormatTime(t time.Time) string {
	us := t.UnixMicro()
	sign := ""
	if us < 0 {
		sign, us = "-", -us
	}
	frac := strconv.FormatInt(us%1e6, 10)
	return sign + strconv.FormatInt(us/1e6, 10) + "." + strings.Repeat("0", 6-len(frac)) + frac
}

// ParseTime reads a time header: any decimal number of unix seconds
// (FormatTime's form, an integer, a Python float), to the microsecond. A
// value above 1e11 is unix milliseconds, the encoding RabbitMQ
// copies carried before, so copies still queued from then read right. It
// returns an error wrapping ErrNotTime for an empty or malformed value, NaN,
// ±Inf, zero or a negative number, or one beyond the year 5138.
func ParseTime(s string) (time.Time, error) {
	s = strings.TrimSpace(s)
	if t, ok, err := parseDecimal(s); ok {
		return t, err
	}
	f, err := strconv.ParseFloat(s, 64)
	switch {
	case err != nil, math.IsNaN(f), math.IsInf(f, 0), f <= 0:
		return time.Time{}, fmt.Errorf("%w: %s", ErrNotTime, quote(s))
	case f > maxMillis:
		return time.Time{}, fmt.Errorf("%w: %s is out of range", ErrNotTime, quote(s))
	case f > millisThreshold:
		ms, frac := math.Modf(f)
		return time.UnixMilli(int64(ms)).Add(time.Duration(math.Round(frac*1e3)) * time.Microsecond), nil
	}
	sec, frac := math.Modf(f)
	return time.Unix(int64(sec), int64(math.Round(frac*1e6))*1e3), nil
}

// parseDecimal reads the plain form "<digits>[.<digits>]" exactly, to the
// microsecond (further digits are dropped), where a float64 would lose
// microseconds on large values. ok is false for any other form.
func parseDecimal(s string) (t time.Time, ok bool, err error) {
	whole, frac, _ := strings.Cut(s, ".")
	if whole == "" || len(whole) > 15 || !digits(whole) || !digits(frac) {
		return time.Time{}, false, nil
	}
	n, _ := strconv.ParseInt(whole, 10, 64) // ≤ 15 digits: cannot fail
	scale := int64(1_000_000)               // microseconds per unit of whole
	if n > millisThreshold {
		scale = 1000
	}
	var sub int64 // the fraction, in microseconds
	for i, unit := 0, scale/10; i < len(frac) && unit > 0; i, unit = i+1, unit/10 {
		sub += int64(frac[i]-'0') * unit
	}
	us := n*scale + sub
	switch {
	case us <= 0:
		return time.Time{}, true, fmt.Errorf("%w: %s", ErrNotTime, quote(s))
	case n > maxMillis:
		return time.Time{}, true, fmt.Errorf("%w: %s is out of range", ErrNotTime, quote(s))
	}
	return time.UnixMicro(us), true, nil
}

func digits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// NotBefore reads a retry copy's no_abans without trusting it further than
// the reader's own configuration: maxWait is the longest the reader itself
// ever makes a copy wait (its maximum backoff). A time beyond now + maxWait,
// including a finite number too large to be a time (1e300), gives now +
// maxWait, so a forged or broken copy is held at most that long. A value
// that is no number at all (empty, malformed, NaN, ±Inf) or not positive
// gives the zero time: the copy is due at once, as a copy without the header
// is. maxWait ≤ 0 means no wait is ever trusted.
func NotBefore(s string, now time.Time, maxWait time.Duration) time.Time {
	limit := now.Add(max(maxWait, 0))
	t, err := ParseTime(s)
	if err != nil {
		if f, perr := strconv.ParseFloat(strings.TrimSpace(s), 64); perr == nil && f > maxMillis && !math.IsInf(f, 0) {
			return limit // a number, only too far away
		}
		return time.Time{}
	}
	if t.After(limit) {
		return limit
	}
	return t
}

// Attempt returns the number of the attempt a retry copy whose intents
// header is s is on: intents + 1, with intents read without trusting it
// further than the reader's configuration. intents below 1, or not an
// integer, counts as 1 (the copy was made after at least one failure);
// intents at or beyond maxAttempts − 1 makes it the last attempt,
// maxAttempts, so a failure sends it to the DLQ. The result is at least 2.
func Attempt(s string, maxAttempts int) int {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	switch {
	case errors.Is(err, strconv.ErrRange) && n > 0:
		n = math.MaxInt // too large for an int: as large as it gets
	case err != nil, n < 1:
		n = 1
	}
	return max(min(n, maxAttempts-1)+1, 2)
}

// TypeHeader gathers the tipus headers of one message (Add each value, in
// order) to decide whether a consumer may filter on them before decoding
// and whether they agree with the envelope. A message has one tipus header
// equal to its envelope's tipus; Kafka allows several headers of one name,
// and any header may hold bytes that are not text.
type TypeHeader struct {
	first, other string
	n            int
	bad, notText bool
}

// Add records one value of a tipus header.
func (h *TypeHeader) Add(v string) {
	h.n++
	switch {
	case h.n == 1:
		h.first = v
		h.bad = v == "" || !utf8.ValidString(v)
	case v != h.first && !h.bad:
		h.other, h.bad = v, true
	}
}

// AddNotText records a tipus header whose value is not text at all (an
// AMQP number or table, say), by a rendering of it: the header is then
// ambiguous.
func (h *TypeHeader) AddNotText(rendering string) {
	h.Add(rendering)
	h.bad = true
	if h.n == 1 {
		h.notText = true
	}
}

// Filter returns the tipus to filter on before decoding, and true, when the
// message has at least one tipus header and they all hold the same
// non-empty UTF-8 text. Otherwise the header is absent or ambiguous and the
// consumer must decode the envelope to know the tipus.
func (h *TypeHeader) Filter() (string, bool) { return h.first, h.n > 0 && !h.bad }

// Check returns nil when the message has no tipus header or when every one
// of them equals envType, the decoded envelope's tipus. Otherwise it returns
// an error whose text, after "esquema: ", names the header values (quoted,
// cut) and the envelope's tipus; the consumer dead-letters the message as a
// permanent failure rather than guess which one is right.
func (h *TypeHeader) Check(envType string) error {
	if h.n == 0 || (!h.bad && h.first == envType) {
		return nil
	}
	got := quote(h.first)
	switch {
	case h.other != "":
		got = "ambiguous: " + got + " and " + quote(h.other)
	case h.notText:
		got = "not text " + got
	case h.first != "" && !utf8.ValidString(h.first):
		got = "not UTF-8 " + got
	}
	return fmt.Errorf("%w: header tipus %s does not match the envelope's %s", ErrTypeMismatch, got, quote(envType))
}

// ErrTypeMismatch is wrapped by TypeHeader.Check's errors; its text is the
// class of the dead letter's motiu ("permanent: esquema").
var ErrTypeMismatch = errors.New("esquema")

// quote renders a header value for an error text: Go-quoted (so bytes that
// are not text show as escapes) and cut to 40 bytes.
func quote(s string) string {
	if len(s) > 40 {
		cut := 40
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		return strconv.Quote(s[:cut]) + "…"
	}
	return strconv.Quote(s)
}
