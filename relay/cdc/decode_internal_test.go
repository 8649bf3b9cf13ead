package cdc

import (
	"encoding/binary"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/km0/km0/migrate"
)

// A malformed or truncated Insert message is an error, never a panic or a
// value read past its end; a timestamp
// time.Time cannot hold is an error too.
func TestParseInsertRefusesTruncatedMessagesAndReadsValues(t *testing.T) {
	msg := []byte{'I', 0, 0, 0, 7, 'N', 0, 2, 't', 0, 0, 0, 3, 'a', 'b', 'c', 'n'}
	rel, cols, err := parseInsert(msg, nil)
	if err != nil || rel != 7 || len(cols) != 2 || string(cols[0].data) != "abc" || cols[1].kind != pglogrepl.TupleDataTypeNull {
		t.Fatalf("parseInsert: %d %+v %v", rel, cols, err)
	}
	for cut := 1; cut < len(msg)-1; cut++ {
		if _, _, err := parseInsert(msg[:cut], nil); err == nil {
			t.Fatalf("truncated at %d: no error", cut)
		}
	}
	bad := append([]byte(nil), msg...)
	binary.BigEndian.PutUint32(bad[9:], 1<<31) // a length past the end
	if _, _, err := parseInsert(bad, nil); err == nil {
		t.Fatal("a length past the end: no error")
	}
	d := newDecoder(migrate.Names{}, slog.Default())
	ts, err := d.timestamptz([]byte("2026-12-01 11:14:22.5+00"))
	if err != nil || !ts.Equal(time.Date(2026, 12, 1, 11, 14, 22, 5e8, time.UTC)) {
		t.Fatalf("timestamptz: %v %v", ts, err)
	}
	if ts, err := d.timestamptz([]byte("2026-12-01 11:14:22+00")); err != nil || ts.Nanosecond() != 0 {
		t.Fatalf("timestamptz without a fraction: %v %v", ts, err)
	}
	if _, err := d.timestamptz([]byte("infinity")); err == nil {
		t.Fatal("timestamptz infinity: no error (time.Time cannot hold it)")
	}
}
