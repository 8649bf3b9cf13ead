package dlq_test

import (
	"errors"
	"testing"
	"time"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/transport"
)

// Bad headers never stop a letter from being built: they leave "unknown".
func TestNewLetterToleratesBadHeaders(t *testing.T) {
	t.Parallel()
	m := &transport.Message{Key: []byte("k"), Value: []byte("not json"), Headers: []transport.Header{
		{Key: "intents", Value: "three"}, {Key: "particio_original", Value: "-4"},
		{Key: "primera_fallada", Value: "NaN"}, {Key: "motiu", Value: "permanent: x"},
	}}
	at := time.Date(2026, 3, 1, 10, 0, 0, 0, time.UTC)
	l := dlq.NewLetter("a.b.dlq", 2, 9, at, m)
	if l.ID != "a.b.dlq/2/9" || l.OriginalTopic != "a.b" || l.Attempts != 0 || l.OriginalPartition != -1 ||
		l.OriginalOffset != -1 || !l.FirstFailure.IsZero() || l.EventID != "" || !l.DeadAt.Equal(at) {
		t.Fatalf("letter: %+v", l)
	}
	if !l.Oldest().Equal(at) {
		t.Fatalf("oldest %v, want the dead time", l.Oldest())
	}
	m.Headers = append(m.Headers, transport.Header{Key: "primera_fallada", Value: "1772355600.5"})
	m.Headers[2].Value = "1772355600.5"
	l = dlq.NewLetter("a.b.dlq", 2, 9, at, m)
	if want := time.Unix(1772355600, 5e8).UTC(); !l.FirstFailure.Equal(want) || !l.Oldest().Equal(want) {
		t.Fatalf("primera_fallada %v, oldest %v, want %v", l.FirstFailure, l.Oldest(), want)
	}
}

func TestParseKafkaID(t *testing.T) {
	t.Parallel()
	topic, p, o, err := dlq.ParseKafkaID("comandes.esdeveniments.dlq/5/120")
	if err != nil || topic != "comandes.esdeveniments.dlq" || p != 5 || o != 120 {
		t.Fatalf("%q %d %d %v", topic, p, o, err)
	}
	for _, bad := range []string{"", "x", "x/1", "/1/2", "x/a/2", "x/1/-2", "x/-1/2"} {
		if _, _, _, err := dlq.ParseKafkaID(bad); !errors.Is(err, dlq.ErrBadID) {
			t.Errorf("ParseKafkaID(%q): %v, want ErrBadID", bad, err)
		}
	}
}

func TestParseTime(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 10, 12, 0, 0, 0, time.UTC)
	cases := map[string]time.Time{
		"":                     {},
		"2026-03-01":           time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC),
		"2026-03-01T10:30:00Z": time.Date(2026, 3, 1, 10, 30, 0, 0, time.UTC),
		"36h":                  now.Add(-36 * time.Hour),
		"7d":                   now.Add(-7 * 24 * time.Hour),
	}
	for in, want := range cases {
		got, err := dlq.ParseTime(in, now)
		if err != nil || !got.Equal(want) {
			t.Errorf("ParseTime(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"yesterday", "-3h", "3x", "200000d"} {
		if _, err := dlq.ParseTime(bad, now); err == nil {
			t.Errorf("ParseTime(%q) accepted", bad)
		}
	}
}
