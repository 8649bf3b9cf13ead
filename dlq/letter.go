// Package dlq operates dead letters: it indexes the records of the `<topic>.dlq`
// topics in PostgreSQL (table cartes_mortes), lists and shows them, replays
// them to their original topic with the same key and id_esdeveniment (so an
// idempotent consumer that already applied the effect reports a duplicate),
// purges them, and raises an alert for every new one: a Prometheus counter, an
// error-level log line and an optional webhook. No DLQ is a silent black hole.
//
// The broker-specific part is a Backend (KafkaBackend here; a RabbitMQ one can
// plug in); Service puts a Backend, the Store and an Alerter together behind
// Source, which `km0 dlq` and Handler (the HTTP admin API) use.
package dlq

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
)

// HeaderReplayedFrom is added by Replay: the ID of the letter a record was
// republished from. Consumers may ignore it. The headers a consumer writes
// on a dead letter are package contract's (contract.CopyHeaders).
const HeaderReplayedFrom = "reproduida_de"

// State is where a letter stands in the index.
type State string

// The states of a letter (column estat).
const (
	StatePending  State = "pendent"    // dead, not yet replayed or purged
	StateReplayed State = "reproduida" // republished to its original topic
	StatePurged   State = "purgada"    // given up on by an operator
)

// ParseState accepts the Catalan names and their English equivalents
// (pending, replayed, purged). "" and "totes"/"all" return nil (every state).
func ParseState(s string) ([]State, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "totes", "all":
		return nil, nil
	case "pendent", "pending":
		return []State{StatePending}, nil
	case "reproduida", "replayed":
		return []State{StateReplayed}, nil
	case "purgada", "purged":
		return []State{StatePurged}, nil
	}
	return nil, fmt.Errorf("dlq: unknown state %q (pendent, reproduida, purgada or totes)", s)
}

// Letter is one dead letter.
type Letter struct {
	// ID is stable: "<dlq topic>/<partition>/<offset>" for Kafka.
	ID        string
	Topic     string // the DLQ topic, e.g. comandes.esdeveniments.dlq
	Partition int32
	Offset    int64

	OriginalTopic     string // topic_original, else Topic without ".dlq"
	OriginalPartition int32  // particio_original; -1 when absent
	OriginalOffset    int64  // offset_original; -1 when absent

	EventID string // id_esdeveniment header, else from the envelope; "" if unknown
	Type    string // tipus header, else from the envelope; "" if unknown

	Reason       string    // motiu, as written (the index keeps at most MaxIndexedText bytes of it)
	Attempts     int       // intents; 0 when absent, negative or not a number; at most 2^31-1
	FirstFailure time.Time // primera_fallada; zero when absent
	EventTime    time.Time // the earliest of the envelope's data_ms and data_original; zero when neither is known
	DeadAt       time.Time // the record's timestamp; zero when unknown (TimeUnknown)
	// TimeUnknown is true when a time of the letter (DeadAt, FirstFailure or
	// EventTime) was given but outside the range the index keeps (from the
	// unix epoch to 24 h after indexing): that time is zero
	// instead, and the letter's age is unknown (Replay refuses it without
	// Force; --since/--until never select a letter whose DeadAt is unknown).
	TimeUnknown   bool
	ConsumerGroup string // grup_consumidor

	Key     []byte
	Value   []byte // the original envelope bytes, possibly malformed
	Headers []transport.Header

	State      State
	Replays    int       // how many times it was republished
	ReplayedAt time.Time // last replay; zero if never
	PurgedAt   time.Time // zero if not purged

	// Copies is, in a folded listing (Filter.Fold), how many letters
	// of the selection share this one's event and consumer (1: no
	// duplicate); 0 elsewhere.
	Copies int
}

// History returns the letter's attempt history (header historial_intents,
// contract.ParseHistory): its last failed attempts, oldest first, each with
// its error and time; nil when the letter carries none (a native RabbitMQ
// dead letter, or one written before the header existed).
func (l *Letter) History() []contract.FailedAttempt {
	for _, h := range l.Headers {
		if h.Key == contract.HeaderHistory {
			return contract.ParseHistory(h.Value)
		}
	}
	return nil
}

// Class returns the bounded reason class of the letter (contract.ReasonClass).
func (l *Letter) Class() string { return contract.ReasonClass(l.Reason) }

// Oldest returns the earliest of the letter's known times (event time, first
// failure, dead time): the earliest moment a consumer can have recorded its
// idempotency key, which is what the retention check of Replay measures.
//
// It is zero when DeadAt is unknown and no other time is known.
func (l *Letter) Oldest() time.Time {
	t := l.DeadAt
	for _, c := range []time.Time{l.FirstFailure, l.EventTime} {
		if !c.IsZero() && (t.IsZero() || c.Before(t)) {
			t = c
		}
	}
	return t
}

// Envelope decodes the letter's value, or returns the permanent decoding error
// (for a poison message).
func (l *Letter) Envelope() (*envelope.Envelope, error) { return envelope.Decode(l.Value) }

// ErrBadID is returned for a letter ID that is not "<topic>/<partition>/<offset>".
var ErrBadID = errors.New("dlq: bad letter id")

// KafkaID returns the ID of the record at topic/partition/offset.
func KafkaID(topic string, partition int32, offset int64) string {
	return topic + "/" + strconv.FormatInt(int64(partition), 10) + "/" + strconv.FormatInt(offset, 10)
}

// ParseKafkaID splits an ID made by KafkaID. It returns ErrBadID (wrapped) for
// anything else.
func ParseKafkaID(id string) (topic string, partition int32, offset int64, err error) {
	i := strings.LastIndexByte(id, '/')
	if i <= 0 {
		return "", 0, 0, fmt.Errorf("%w %q", ErrBadID, id)
	}
	j := strings.LastIndexByte(id[:i], '/')
	if j <= 0 {
		return "", 0, 0, fmt.Errorf("%w %q", ErrBadID, id)
	}
	p, err1 := strconv.ParseInt(id[j+1:i], 10, 32)
	o, err2 := strconv.ParseInt(id[i+1:], 10, 64)
	if err1 != nil || err2 != nil || p < 0 || o < 0 {
		return "", 0, 0, fmt.Errorf("%w %q", ErrBadID, id)
	}
	return id[:j], int32(p), o, nil
}

// NewLetter builds the Letter of a record read from a DLQ topic. It never
// fails: missing or malformed headers leave their fields at the documented
// "unknown" values, because a letter that cannot be indexed would be lost.
//
// A time outside the range the index keeps (ts included; see inRange) is stored as unknown: zero,
// with TimeUnknown set, so that the letter is indexed like the others.
func NewLetter(topic string, partition int32, offset int64, ts time.Time, m *transport.Message) *Letter {
	l := &Letter{
		ID: KafkaID(topic, partition, offset), Topic: topic, Partition: partition, Offset: offset,
		OriginalPartition: -1, OriginalOffset: -1,
		DeadAt: ts.UTC(), Key: m.Key, Value: m.Value, Headers: m.Headers, State: StatePending,
	}
	defer func() {
		now := time.Now()
		for _, t := range []*time.Time{&l.DeadAt, &l.FirstFailure, &l.EventTime} {
			if !t.IsZero() && !inRange(*t, now) {
				*t, l.TimeUnknown = time.Time{}, true
			}
		}
		if l.DeadAt.IsZero() {
			l.TimeUnknown = true
		}
	}()
	h := func(k string) string { v, _ := m.Header(k); return v }
	l.OriginalTopic = h(contract.HeaderOriginalTopic)
	if l.OriginalTopic == "" {
		l.OriginalTopic = strings.TrimSuffix(topic, contract.DLQSuffix)
	}
	if v, err := strconv.ParseInt(h(contract.HeaderOriginalPartition), 10, 32); err == nil && v >= 0 {
		l.OriginalPartition = int32(v)
	}
	if v, err := strconv.ParseInt(h(contract.HeaderOriginalOffset), 10, 64); err == nil && v >= 0 {
		l.OriginalOffset = v
	}
	l.Reason = h(contract.HeaderReason)
	// Clamped to the INTEGER column: a value out of range parses as
	// MaxInt64 (strconv.ErrRange), a negative one or garbage as 0.
	if v, _ := strconv.ParseInt(h(contract.HeaderAttempts), 10, 64); v > 0 {
		l.Attempts = int(min(v, math.MaxInt32))
	}
	l.FirstFailure = unixSeconds(h(contract.HeaderFirstFailure))
	l.ConsumerGroup = h(contract.HeaderGroup)
	l.EventID = h(contract.HeaderEventID)
	l.Type = h(contract.HeaderType)
	if e, err := envelope.Decode(m.Value); err == nil {
		if l.EventID == "" {
			l.EventID = e.ID
		}
		if l.Type == "" {
			l.Type = e.Type
		}
		if e.TimeMS > 0 {
			l.EventTime = time.UnixMilli(e.TimeMS).UTC()
		}
	}
	// data_ms is optional (and set by the producer): the source record's own
	// timestamp also bounds when another group can have stored the key.
	if t := unixSeconds(h(contract.HeaderOriginalTime)); !t.IsZero() && (l.EventTime.IsZero() || t.Before(l.EventTime)) {
		l.EventTime = t
	}
	return l
}

// minTime and maxFuture bound the times the index stores (see NewLetter):
// no dead letter predates the unix epoch, and none dies, fails or is
// produced more than maxFuture (clock skew) after it is indexed. A time
// outside them is a broken clock or a wrapped encoding (a Kafka timestamp of
// the year -10700 reads back as the 22nd century), not a time to filter or
// age by.
var (
	minTime   = time.Unix(0, 0).UTC()
	maxFuture = 24 * time.Hour
)

// inRange reports whether t is within [minTime, now+maxFuture].
func inRange(t, now time.Time) bool { return !t.Before(minTime) && !t.After(now.Add(maxFuture)) }

// unixSeconds reads a time header (contract.ParseTime: unix seconds, or the
// milliseconds RabbitMQ copies carried before); anything else is the zero
// time.
func unixSeconds(s string) time.Time {
	t, err := contract.ParseTime(s)
	if err != nil {
		return time.Time{}
	}
	return t.UTC()
}

// replayHeaders drops from h the headers of the retry and DLQ machinery
// (intents, no_abans, ultim_error, motiu, mort_en and the original-position headers),
// keeping tipus, id_esdeveniment and anything else (trace context), and adds
// reproduida_de. The retry count therefore starts again at the first attempt.
func replayHeaders(h []transport.Header, letterID string) []transport.Header {
	out := make([]transport.Header, 0, len(h)+1)
	for _, x := range h {
		switch x.Key {
		case contract.HeaderAttempts, contract.HeaderNotBefore, contract.HeaderLastError,
			contract.HeaderReason, contract.HeaderOriginalTopic, contract.HeaderOriginalPartition,
			contract.HeaderOriginalOffset, contract.HeaderFirstFailure, contract.HeaderGroup, contract.HeaderOriginalTime, HeaderReplayedFrom,
			contract.HeaderDeadAt:
			continue
		}
		out = append(out, x)
	}
	return append(out, transport.Header{Key: HeaderReplayedFrom, Value: letterID})
}

// replayMessage is the record Replay publishes for l: to its original topic
// or queue, addressed to the consumer that dead-lettered it (header
// grup_consumidor, when the letter names one; see Backend.Publish).
func replayMessage(l *Letter) *transport.Message {
	m := &transport.Message{Topic: l.OriginalTopic, Key: l.Key, Value: l.Value,
		Headers: replayHeaders(l.Headers, l.ID)}
	if l.ConsumerGroup != "" {
		m.SetHeader(contract.HeaderGroup, l.ConsumerGroup)
	}
	// A letter whose headers lost tipus/id_esdeveniment still carries them in
	// the envelope; put them back so consumers can filter on headers.
	if _, ok := m.Header(contract.HeaderType); !ok && l.Type != "" {
		m.SetHeader(contract.HeaderType, l.Type)
	}
	if _, ok := m.Header(contract.HeaderEventID); !ok && l.EventID != "" {
		m.SetHeader(contract.HeaderEventID, l.EventID)
	}
	return m
}

// PrettyValue renders a letter's value for a terminal: indented JSON when it
// is JSON, else the bytes as a quoted Go string (control characters, invalid
// UTF-8 and terminal escapes shown as escapes), cut to max bytes (0: 64 KiB).
// The bool reports whether it was JSON. Either way the result holds no
// control character but newlines.
func PrettyValue(v []byte, max int) (string, bool) {
	if max <= 0 {
		max = 64 << 10
	}
	if json.Valid(v) {
		var buf bytes.Buffer
		if err := json.Indent(&buf, v, "", "  "); err == nil {
			s := buf.String()
			suffix := ""
			if len(s) > max {
				s, suffix = outcome.Truncate(s, max), fmt.Sprintf("\n… (%d bytes in all)", len(v))
			}
			lines := strings.Split(s, "\n")
			for i := range lines {
				lines[i] = Safe(lines[i])
			}
			return strings.Join(lines, "\n") + suffix, true
		}
	}
	s, suffix := v, ""
	if len(s) > max {
		s, suffix = s[:max], fmt.Sprintf(" … (%d bytes in all)", len(v))
	}
	return strconv.Quote(string(s)) + suffix, false
}

// Safe returns s with control characters, non-graphic runes and invalid UTF-8
// escaped, for printing text that came from a message (a motiu, a header) on
// a terminal. Printable text is returned as it is.
func Safe(s string) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || !unicode.IsGraphic(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	q := strconv.QuoteToGraphic(s)
	return q[1 : len(q)-1]
}
