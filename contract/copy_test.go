package contract_test

import (
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/contract"
)

func headersOf(kv []contract.KV) map[string]string {
	m := map[string]string{}
	for _, x := range kv {
		m[x.Key] = x.Value
	}
	return m
}

// The one builder of retry and dead-letter headers (both sources call it):
// a first delivery's headers are not read; a copy of a copy keeps the first
// failure's position and times, rewritten in the one encoding, and replaces
// a time that does not parse by this failure's (data_original: the
// timestamp, or none when that is unknown).
func TestCopyHeadersKeepTheFirstFailureAndReplaceUnparsableTimes(t *testing.T) {
	t.Parallel()
	now := time.Unix(1789000100, 0)
	stamp := time.Unix(1789000050, 0)
	prior := map[string]string{
		"topic_original": "comandes.esdeveniments", "particio_original": "4", "offset_original": "77",
		"primera_fallada": "1789000000123", "data_original": "ahir", "historial_intents": "[",
	}
	get := func(k string) string { return prior[k] }
	f := contract.Failure{Attempt: 1, LastError: "e1", NotBefore: now.Add(time.Second), Origin: "o", Partition: 1, Offset: 9,
		Group: "g", Now: now, Prior: get}
	h := headersOf(contract.CopyHeaders(f))
	if h["topic_original"] != "o" || h["particio_original"] != "1" || h["offset_original"] != "9" ||
		h["primera_fallada"] != contract.FormatTime(now) || h["no_abans"] != contract.FormatTime(now.Add(time.Second)) {
		t.Errorf("first delivery: %v, want its own position and now", h)
	}
	if _, ok := h["data_original"]; ok {
		t.Errorf("first delivery without timestamp: data_original %q, want none", h["data_original"])
	}
	f.Attempt, f.Dead, f.Reason = 3, true, "transitori esgotat: e3"
	h = headersOf(contract.CopyHeaders(f))
	if h["topic_original"] != "comandes.esdeveniments" || h["particio_original"] != "4" || h["offset_original"] != "77" ||
		h["primera_fallada"] != "1789000000.123000" || h["mort_en"] != contract.FormatTime(now) || h["motiu"] != f.Reason {
		t.Errorf("dead letter of a copy: %v, want the first failure's position and time", h)
	}
	if _, ok := h["no_abans"]; ok {
		t.Errorf("dead letter with no_abans %q", h["no_abans"])
	}
	if _, ok := h["data_original"]; ok {
		t.Errorf("unparsable data_original and no timestamp: %q, want none", h["data_original"])
	}
	prior["primera_fallada"] = "NaN"
	f.Timestamp = stamp
	h = headersOf(contract.CopyHeaders(f))
	if h["primera_fallada"] != contract.FormatTime(now) || h["data_original"] != contract.FormatTime(stamp) {
		t.Errorf("unparsable times: primera_fallada %q, data_original %q; want now and the timestamp", h["primera_fallada"], h["data_original"])
	}
	if got := contract.ParseHistory(h["historial_intents"]); len(got) != 1 || got[0].N != 3 || got[0].Error != "e1" || !got[0].At.Equal(now) {
		t.Errorf("history after an unparsable one: %+v", got)
	}
}

// The history grows by one attempt per copy and stays bounded: the last
// MaxHistory attempts, each error cut to MaxHistoryError bytes.
func TestHistoryIsBounded(t *testing.T) {
	t.Parallel()
	var hist string
	long := strings.Repeat("é", 200)
	for n := 1; n <= 15; n++ {
		f := contract.Failure{Attempt: n, LastError: long, Now: time.Unix(1789000000+int64(n), 0),
			Prior: func(k string) string {
				if k == contract.HeaderHistory {
					return hist
				}
				return ""
			}}
		hist = headersOf(contract.CopyHeaders(f))[contract.HeaderHistory]
	}
	h := contract.ParseHistory(hist)
	if len(h) != contract.MaxHistory || h[0].N != 6 || h[len(h)-1].N != 15 {
		t.Fatalf("history of 15 attempts: %d entries, first %d; want %d from 6", len(h), h[0].N, contract.MaxHistory)
	}
	for _, a := range h {
		if len(a.Error) > contract.MaxHistoryError || !strings.HasPrefix(long, a.Error) || len(a.Error) < contract.MaxHistoryError-1 {
			t.Fatalf("error of %d bytes, want at most %d on a rune boundary", len(a.Error), contract.MaxHistoryError)
		}
	}
	if len(hist) > 2500 {
		t.Errorf("history header of %d bytes", len(hist))
	}
	if contract.ParseHistory("{no") != nil || contract.ParseHistory("") != nil {
		t.Error("a malformed history is not none")
	}
}
