package outbox

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
)

// walSamples are WAL-mode contents: EncodeWAL's own (all but the last
// without escapes in their strings: the fast path's) and other writers'
// layouts and bad content (encoding/json's path).
func walSamples(t testing.TB) (encoded, other [][]byte) {
	at := time.Date(2026, 12, 8, 1, 2, 3, 456789000, time.UTC)
	rows := []Row{
		{Aggregate: "comanda", AggregateID: "P-2026-000042", Type: "comanda.creada", Version: 1,
			Payload: json.RawMessage(`{"id":"P-2026-000042","linies":[{"producte":"formatge-curat","quantitat":2}]}`)},
		{Aggregate: "comanda", AggregateID: "P-2026-000043", Type: "comanda.creada", Version: 12,
			Payload: json.RawMessage(`{"nota":"} ] { [ \" \\"}`), Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}},
		{Aggregate: "comanda", AggregateID: "Pèrgola-ñ-€", Type: "comanda.creada", Version: 3,
			Payload: json.RawMessage(`{"a":{"b":1},"capcaleres":{"x":"y"}}`), Headers: map[string]string{"a": "<b>&", "z": "1", "línia": "\t"}},
		{Aggregate: "comanda", AggregateID: "P-3", Type: "comanda.creada", Version: 999999999,
			Payload: json.RawMessage(` { "x" : [ 1 , 2 ] }` + "\n"), Headers: map[string]string{}},
		// Escapes in the strings: encoding/json's path.
		{Aggregate: "comanda", AggregateID: "P-\"quoted\"\\x\x01", Type: "comanda.creada", Version: 12,
			Payload: json.RawMessage(`{}`), Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}},
	}
	for i := range rows {
		rows[i].ID, rows[i].CreatedAt = uuid.New(), at
		b, err := EncodeWAL(&rows[i])
		if err != nil {
			t.Fatal(err)
		}
		encoded = append(encoded, b)
	}
	id := uuid.NewString()
	for _, s := range []string{
		`{"id":"` + id + `","v":1,"agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{ "v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{},"capcaleres":{"a":"1","a":"2"}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{},"capcaleres":{"a":1,"b":null,"c":"ok"}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{},"capcaleres":{"id_esdeveniment":"x"}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{},"capcaleres":{"a":"1"`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{"x":}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{"x":"\u0000"}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":01,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":-1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1.0,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":12345678901,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{"v":2,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":[1]}`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}x`,
		`{"v":1,"id":"` + id + `","agregat":"comanda","agregat_id":"P-\xff","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{"v":1,"id":"not-a-uuid","agregat":"comanda","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"ahir","carrega":{}}`,
		`{"v":1,"id":"` + id + `","agregat":"","agregat_id":"P-1","tipus":"t","versio":1,"creat_en":"2026-12-08T01:02:03.456789Z","carrega":{}}`,
		`{"v":1}`, `{}`, `null`, ``, `[`, `"x"`,
	} {
		other = append(other, []byte(s))
	}
	return encoded, other
}

// The fast path reads every content EncodeWAL writes, and for any content
// both paths give the same row, the same header error and the same error.
func TestDecodeWALFastPathAgreesWithEncodingJSON(t *testing.T) {
	t.Parallel()
	encoded, other := walSamples(t)
	for _, c := range encoded[:len(encoded)-1] {
		if _, ok := scanWAL(c); !ok {
			t.Errorf("EncodeWAL's content takes the slow path: %s", c)
		}
	}
	for _, c := range append(encoded, other...) {
		compareWALPaths(t, c)
	}
}

// The row refers to no byte of the content: the relay passes the receive
// buffer, which the next message overwrites.
func TestDecodeWALRowOutlivesItsContent(t *testing.T) {
	t.Parallel()
	encoded, _ := walSamples(t)
	for _, c := range encoded {
		want, _, err := DecodeWAL(c)
		if err != nil {
			t.Fatal(err)
		}
		buf := slices.Clone(c)
		got, _, _ := DecodeWAL(buf)
		for i := range buf {
			buf[i] = 'x'
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("the row changed with its content:\n got %+v\nwant %+v", got, want)
		}
	}
}

func FuzzDecodeWALPaths(f *testing.F) {
	encoded, other := walSamples(f)
	for _, c := range append(encoded, other...) {
		f.Add(c)
	}
	f.Fuzz(func(t *testing.T, c []byte) { compareWALPaths(t, c) })
}

func compareWALPaths(t *testing.T, c []byte) {
	t.Helper()
	fr, fh, fe := decodeWAL(c, true)
	sr, sh, se := decodeWAL(c, false)
	if !reflect.DeepEqual(fr, sr) || errLines(fh) != errLines(sh) || errLines(fe) != errLines(se) {
		t.Fatalf("content %q:\nfast %+v, %v, %v\nslow %+v, %v, %v", c, fr, fh, fe, sr, sh, se)
	}
}

// errLines is err's text with its joined lines sorted (encoding/json's
// path joins header errors in map order), "" for nil.
func errLines(err error) string {
	if err == nil {
		return ""
	}
	l := strings.Split(err.Error(), "\n")
	slices.Sort(l)
	return strings.Join(l, "\n")
}

// DecodeHeaders' fast path takes json.Marshal's and jsonb's layouts of
// plain headers, and for any input both paths give the same headers and
// the same error.
func TestDecodeHeadersFastPathAgreesWithEncodingJSON(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{`{"traceparent":"00-4bf9-01","tracestate":"k=v"}`, `{"a": "1", "b": "2"}`, ` { } `, `{}`} {
		if !scanHeaders([]byte(raw), func(string, string) {}) {
			t.Errorf("%s takes the slow path", raw)
		}
	}
	for _, raw := range headerSamples {
		compareHeaderPaths(t, []byte(raw))
	}
}

var headerSamples = []string{
	`{"traceparent":"00-4bf9-01","tracestate":"k=v"}`, `{"a": "1", "b": "2"}`, ` { } `, `{}`, `null`, ``,
	`{"a":"1","a":"2"}`, `{"a":"1","a":2}`, `{"a":1,"b":null,"c":"ok"}`, `{"id_esdeveniment":"x","b":"y"}`,
	`{"":"x"}`, `{"a":"\u003cb\u003e"}`, `{"a":"\u0000"}`, `{"a":"1",}`, `{"a":"1"`, `{"a" "1"}`, `[]`, `"x"`,
	`{"a":"1"} x`, `{"a":"` + strings.Repeat("v", MaxHeadersBytes) + `"}`, "{\"\xff\":\"1\"}", `{"è":"€"}`,
}

func FuzzDecodeHeadersPaths(f *testing.F) {
	for _, raw := range headerSamples {
		f.Add([]byte(raw))
	}
	f.Fuzz(func(t *testing.T, raw []byte) { compareHeaderPaths(t, raw) })
}

func compareHeaderPaths(t *testing.T, raw []byte) {
	t.Helper()
	fh, fe := decodeHeaders(raw, true)
	sh, se := decodeHeaders(raw, false)
	if !reflect.DeepEqual(fh, sh) || errLines(fe) != errLines(se) {
		t.Fatalf("capcaleres %q:\nfast %v, %v\nslow %v, %v", raw, fh, fe, sh, se)
	}
}

// An entry over MaxHeadersBytes on its own is dropped alone, on both paths:
// the other entries (the trace context) are still published.
func TestDecodeHeadersDropsAnOversizedEntryAlone(t *testing.T) {
	t.Parallel()
	raw := []byte(`{"traceparent":"00-1","gran":"` + strings.Repeat("v", MaxHeadersBytes) + `"}`)
	for _, fast := range []bool{true, false} {
		h, err := decodeHeaders(raw, fast)
		if !reflect.DeepEqual(h, map[string]string{"traceparent": "00-1"}) || err == nil || !strings.Contains(err.Error(), "over the limit") {
			t.Fatalf("fast %v: %v, %v; want the traceparent kept and the big entry's error", fast, h, err)
		}
	}
}
