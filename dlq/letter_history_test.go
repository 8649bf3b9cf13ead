package dlq_test

import (
	"testing"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/transport"
)

// Letter.History reads the historial_intents header a source wrote
// (contract.CopyHeaders); a letter without one has none.
func TestLetterHistoryReadsTheAttemptHeader(t *testing.T) {
	t.Parallel()
	at := time.Unix(1789000000, 0)
	want := []contract.FailedAttempt{{N: 1, At: at, Error: "a"}, {N: 2, At: at.Add(time.Second), Error: "b"}}
	l := &dlq.Letter{Headers: []transport.Header{{Key: "tipus", Value: "x"}, {Key: contract.HeaderHistory, Value: contract.FormatHistory(want)}}}
	got := l.History()
	if len(got) != 2 || got[0] != want[0] || got[1].N != 2 || !got[1].At.Equal(want[1].At) || got[1].Error != "b" {
		t.Fatalf("History %+v, want %+v", got, want)
	}
	if h := (&dlq.Letter{}).History(); h != nil {
		t.Fatalf("History of a letter without the header: %+v", h)
	}
}
