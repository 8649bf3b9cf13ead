package dlq

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// LetterView is the JSON form of a Letter (`km0 dlq ... --json` and the
// admin API). Unknown values are null or omitted.
type LetterView struct {
	ID                string       `json:"id"`
	Topic             string       `json:"topic"`
	Partition         int32        `json:"particio"`
	Offset            int64        `json:"offset"`
	OriginalTopic     string       `json:"topic_original"`
	OriginalPartition *int32       `json:"particio_original"`
	OriginalOffset    *int64       `json:"offset_original"`
	EventID           string       `json:"id_esdeveniment,omitempty"`
	Type              string       `json:"tipus,omitempty"`
	Reason            string       `json:"motiu"`
	Class             string       `json:"classe_motiu"`
	Attempts          int          `json:"intents"`
	FirstFailure      *time.Time   `json:"primera_fallada,omitempty"`
	EventTime         *time.Time   `json:"data_esdeveniment,omitempty"`
	DeadAt            *time.Time   `json:"morta_en"`                   // null when unknown
	TimeUnknown       bool         `json:"temps_desconegut,omitempty"` // a time was out of range (Letter.TimeUnknown)
	ConsumerGroup     string       `json:"grup_consumidor,omitempty"`
	State             State        `json:"estat"`
	Replays           int          `json:"reproduccions"`
	ReplayedAt        *time.Time   `json:"reproduida_en,omitempty"`
	PurgedAt          *time.Time   `json:"purgada_en,omitempty"`
	Key               string       `json:"clau"`
	KeyBase64         []byte       `json:"clau_base64,omitempty"` // when the key is not UTF-8
	Headers           []HeaderView `json:"capcaleres,omitempty"`
	// History is the attempt history (Letter.History), oldest first; detail only.
	History []AttemptView `json:"historial_intents,omitempty"`
	// Detail only (Show): the value as JSON when it is JSON, else as base64,
	// and why it is not a valid envelope, if it is not.
	Envelope    json.RawMessage `json:"envolupant,omitempty"`
	ValueBase64 []byte          `json:"valor_base64,omitempty"`
	ValueError  string          `json:"error_envolupant,omitempty"`
}

// HeaderView is one header; Base64 is set instead of Value when the value is
// not UTF-8.
type HeaderView struct {
	Key    string `json:"clau"`
	Value  string `json:"valor,omitempty"`
	Base64 []byte `json:"base64,omitempty"`
}

// AttemptView is one failed attempt of a letter's history: its number,
// when it failed (null when unknown) and its error, made safe to show.
type AttemptView struct {
	N     int        `json:"intent"`
	At    *time.Time `json:"en"`
	Error string     `json:"error"`
}

// View returns the JSON form of l; detail adds the value, the headers and
// the attempt history.
func View(l *Letter, detail bool) LetterView {
	v := LetterView{
		ID: l.ID, Topic: l.Topic, Partition: l.Partition, Offset: l.Offset,
		OriginalTopic: l.OriginalTopic, EventID: l.EventID, Type: l.Type,
		Reason: l.Reason, Class: l.Class(), Attempts: l.Attempts, DeadAt: timePtr(l.DeadAt), TimeUnknown: l.TimeUnknown,
		ConsumerGroup: l.ConsumerGroup, State: l.State, Replays: l.Replays,
		FirstFailure: timePtr(l.FirstFailure), EventTime: timePtr(l.EventTime),
		ReplayedAt: timePtr(l.ReplayedAt), PurgedAt: timePtr(l.PurgedAt),
	}
	if l.OriginalPartition >= 0 {
		p := l.OriginalPartition
		v.OriginalPartition = &p
	}
	if l.OriginalOffset >= 0 {
		o := l.OriginalOffset
		v.OriginalOffset = &o
	}
	if utf8.Valid(l.Key) {
		v.Key = string(l.Key)
	} else {
		v.KeyBase64 = l.Key
	}
	if !detail {
		return v
	}
	for _, h := range l.Headers {
		if utf8.ValidString(h.Value) {
			v.Headers = append(v.Headers, HeaderView{Key: h.Key, Value: h.Value})
		} else {
			v.Headers = append(v.Headers, HeaderView{Key: h.Key, Base64: []byte(h.Value)})
		}
	}
	for _, a := range l.History() {
		v.History = append(v.History, AttemptView{N: a.N, At: timePtr(a.At), Error: Safe(a.Error)})
	}
	if json.Valid(l.Value) && utf8.Valid(l.Value) {
		v.Envelope = json.RawMessage(l.Value)
	} else {
		v.ValueBase64 = l.Value
	}
	if _, err := l.Envelope(); err != nil {
		v.ValueError = err.Error()
	}
	return v
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// maxAgeDays is the largest age in days ParseTime accepts: the most days a
// time.Duration holds (about 292 years).
const maxAgeDays = int(math.MaxInt64 / int64(24*time.Hour))

// ParseTime reads a --since/--until value: RFC 3339 ("2026-03-01T10:00:00Z"),
// a date ("2026-03-01", UTC midnight), or an age before now ("90m", "36h",
// "7d"). "" is the zero time (no bound).
func ParseTime(s string, now time.Time) (time.Time, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if t, err := time.Parse("2006-01-02", s); err == nil {
		return t, nil
	}
	if d, ok := strings.CutSuffix(s, "d"); ok {
		// n is bounded so that n days fit in a time.Duration: a wrapped
		// product would put the bound in the future and select every letter.
		if n, err := strconv.Atoi(d); err == nil && n >= 0 && n <= maxAgeDays {
			return now.Add(-time.Duration(n) * 24 * time.Hour), nil
		}
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("dlq: bad time %q: want RFC 3339, YYYY-MM-DD or an age such as 36h or 7d", s)
}
