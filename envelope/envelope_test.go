package envelope_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outcome"
)

const valid = `{"id_esdeveniment":"6f1c9e2a-0000-4000-8000-000000000001","tipus":"comanda.creada","versio":2,"data_ms":1789000000000,"origen":"comandes","dades":{"id":"P-2026-000123"},"nou_camp":[1,2]}`

func TestDecodeValidKeepsUnknownMembers(t *testing.T) {
	t.Parallel()
	e, err := envelope.Decode([]byte(valid))
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	if e.ID != "6f1c9e2a-0000-4000-8000-000000000001" || e.Type != "comanda.creada" || e.Version != 2 ||
		e.TimeMS != 1789000000000 || e.Origin != "comandes" {
		t.Fatalf("unexpected envelope %+v", e)
	}
	if string(e.Extra["nou_camp"]) != "[1,2]" {
		t.Fatalf("unknown member not kept: %v", e.Extra)
	}
	out, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	again, err := envelope.Decode(out)
	if err != nil {
		t.Fatalf("re-decode: %v", err)
	}
	if string(again.Extra["nou_camp"]) != "[1,2]" || string(again.Data) != `{"id":"P-2026-000123"}` {
		t.Fatalf("round trip lost data: %s", out)
	}
}

func TestDecodeRejectsBadInputWithClearPermanentErrors(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, in, want string
	}{
		{"malformed JSON", `{"id_esdeveniment": "x",`, "malformed JSON"},
		{"not an object", `[1,2,3]`, "not a JSON object"},
		{"null", `null`, "not a JSON object"},
		{"missing id", `{"tipus":"a","versio":1,"dades":{}}`, "id_esdeveniment: missing"},
		{"empty id", `{"id_esdeveniment":"","tipus":"a","versio":1,"dades":{}}`, "id_esdeveniment: empty"},
		{"id with NUL", `{"id_esdeveniment":"a\u0000b","tipus":"a","versio":1,"dades":{}}`, "id_esdeveniment: contains a NUL byte"},
		{"id too long", `{"id_esdeveniment":"` + strings.Repeat("x", 300) + `","tipus":"a","versio":1,"dades":{}}`, "id_esdeveniment: 300 bytes, over the limit of 256"},
		{"id wrong type", `{"id_esdeveniment":7,"tipus":"a","versio":1,"dades":{}}`, "id_esdeveniment: must be a string"},
		{"missing tipus", `{"id_esdeveniment":"x","versio":1,"dades":{}}`, "tipus: missing"},
		{"missing versio", `{"id_esdeveniment":"x","tipus":"a","dades":{}}`, "versio: missing"},
		{"zero versio", `{"id_esdeveniment":"x","tipus":"a","versio":0,"dades":{}}`, "versio: must be a positive integer"},
		{"negative versio", `{"id_esdeveniment":"x","tipus":"a","versio":-1,"dades":{}}`, "versio: must be a positive integer"},
		{"fractional versio", `{"id_esdeveniment":"x","tipus":"a","versio":1.5,"dades":{}}`, "versio: must be a positive integer"},
		{"string versio", `{"id_esdeveniment":"x","tipus":"a","versio":"2","dades":{}}`, "versio: must be a positive integer"},
		{"bad data_ms", `{"id_esdeveniment":"x","tipus":"a","versio":1,"data_ms":"ahir","dades":{}}`, "data_ms: must be an integer"},
		{"missing dades", `{"id_esdeveniment":"x","tipus":"a","versio":1}`, "dades: missing"},
		{"dades not object", `{"id_esdeveniment":"x","tipus":"a","versio":1,"dades":[1]}`, "dades: must be a JSON object"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := envelope.Decode([]byte(tc.in))
			if err == nil {
				t.Fatalf("decode accepted %s", tc.in)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not name %q", err, tc.want)
			}
			if !outcome.IsPermanent(err) || !errors.Is(err, envelope.ErrDecode) {
				t.Fatalf("error %q is not a permanent decode error", err)
			}
		})
	}
}

func TestDecodeSizeLimit(t *testing.T) {
	t.Parallel()
	big := `{"id_esdeveniment":"x","tipus":"a","versio":1,"dades":{"p":"` + strings.Repeat("a", 2000) + `"}}`
	_, err := envelope.Decoder{MaxBytes: 1024}.Decode([]byte(big))
	if err == nil || !strings.Contains(err.Error(), "over the limit of 1024") || !outcome.IsPermanent(err) {
		t.Fatalf("want a permanent size error, got %v", err)
	}
	huge := make([]byte, envelope.DefaultMaxBytes+1)
	if _, err := envelope.Decode(huge); err == nil || !strings.Contains(err.Error(), "over the limit") {
		t.Fatalf("default limit not applied: %v", err)
	}
}

func TestEncodeEscapesAndIsValidJSON(t *testing.T) {
	t.Parallel()
	e := &envelope.Envelope{ID: "a\"b", Type: "t<x>", Version: 1, Origin: "orígen", Data: json.RawMessage(`{"k":1}`)}
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(b) {
		t.Fatalf("invalid JSON: %s", b)
	}
	d, err := envelope.Decode(b)
	if err != nil || d.ID != `a"b` || d.Origin != "orígen" {
		t.Fatalf("round trip: %+v %v", d, err)
	}
	if _, err := (&envelope.Envelope{Type: "t", Version: 1}).Encode(); err == nil {
		t.Fatal("encoded an envelope without id")
	}
}

func FuzzDecode(f *testing.F) {
	f.Add([]byte(valid))
	f.Add([]byte(`{"id_esdeveniment":"x","tipus":"a","versio":1e0,"dades":{}}`))
	f.Add([]byte(`{"versio":99999999999999999999}`))
	f.Add([]byte(`"just a string"`))
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := envelope.Decode(b)
		if err != nil {
			if !outcome.IsPermanent(err) {
				t.Fatalf("non-permanent decode error: %v", err)
			}
			return
		}
		out, err := e.Encode()
		if err != nil {
			t.Fatalf("decoded envelope does not encode: %v", err)
		}
		e2, err := envelope.Decode(out)
		if err != nil {
			t.Fatalf("re-decode of %s: %v", out, err)
		}
		if e2.ID != e.ID || e2.Type != e.Type || e2.Version != e.Version {
			t.Fatalf("round trip changed the envelope")
		}
	})
}

func BenchmarkDecode(b *testing.B) {
	in := []byte(valid)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := envelope.Decode(in); err != nil {
			b.Fatal(err)
		}
	}
}

// Encode refuses what Decode would refuse, so a malformed envelope (e.g. an
// outbox row another writer filled with carrega 'null') is caught where it
// is built, not dead-lettered by every consumer.
func TestEncodeRefusesWhatDecodeRefuses(t *testing.T) {
	t.Parallel()
	ok := func() *envelope.Envelope {
		return &envelope.Envelope{ID: "x", Type: "t", Version: 1, Data: json.RawMessage(`{}`)}
	}
	cases := map[string]func(e *envelope.Envelope){
		"dades null":         func(e *envelope.Envelope) { e.Data = json.RawMessage(`null`) },
		"dades array":        func(e *envelope.Envelope) { e.Data = json.RawMessage(` [1]`) },
		"dades string":       func(e *envelope.Envelope) { e.Data = json.RawMessage(`"x"`) },
		"id with NUL":        func(e *envelope.Envelope) { e.ID = "a\x00b" },
		"id too long":        func(e *envelope.Envelope) { e.ID = strings.Repeat("a", envelope.MaxIDBytes+1) },
		"versio over int32":  func(e *envelope.Envelope) { e.Version = 1 << 31 },
		"extra named tipus":  func(e *envelope.Envelope) { e.Extra = map[string]json.RawMessage{"tipus": json.RawMessage(`"u"`)} },
		"extra named dades":  func(e *envelope.Envelope) { e.Extra = map[string]json.RawMessage{"dades": json.RawMessage(`[]`)} },
		"extra named versio": func(e *envelope.Envelope) { e.Extra = map[string]json.RawMessage{"versio": json.RawMessage(`7`)} },
	}
	encoded := 0
	for name, mutate := range cases {
		e := ok()
		mutate(e)
		b, err := e.Encode()
		if err == nil {
			encoded++
			d, derr := envelope.Decode(b)
			t.Errorf("%s: encoded %s; decoded as %+v, %v", name, b, d, derr)
		}
	}
	if encoded != 0 {
		t.Fatalf("%d of %d malformed envelopes encoded, want 0", encoded, len(cases))
	}
	if _, err := ok().Encode(); err != nil {
		t.Fatal(err)
	}
}

// An envelope that readers could read differently is refused: a repeated
// member (encoding/json keeps the last copy, other readers the first), and
// bytes encoding/json would silently replace with U+FFFD.
func TestAmbiguousEnvelopesAreRefused(t *testing.T) {
	const ok = `{"id_esdeveniment":"e1","tipus":"comanda.creada","versio":1,"origen":"comandes","dades":{"a":1}}`
	if _, err := envelope.Decode([]byte(ok)); err != nil {
		t.Fatalf("valid envelope refused: %v", err)
	}
	for name, body := range map[string]string{
		"tipus twice":          `{"id_esdeveniment":"e1","tipus":"comanda.creada","tipus":"comanda.pagada","versio":1,"dades":{}}`,
		"id twice, one escape": `{"id_esdeveniment":"e1","versio":1,"tipus":"t","id_esdevenimen\u0074":"e2","dades":{}}`,
		"dades twice":          `{"id_esdeveniment":"e1","tipus":"t","versio":1,"dades":{"a":1},"dades":{"a":2}}`,
		"tipus not UTF-8":      "{\"id_esdeveniment\":\"e1\",\"tipus\":\"comanda\xff\",\"versio\":1,\"dades\":{}}",
		"id lone surrogate":    `{"id_esdeveniment":"e\ud800","tipus":"t","versio":1,"dades":{}}`,
		"origen not UTF-8":     "{\"id_esdeveniment\":\"e1\",\"tipus\":\"t\",\"versio\":1,\"origen\":\"\xfe\",\"dades\":{}}",
	} {
		_, err := envelope.Decode([]byte(body))
		if err == nil || !outcome.IsPermanent(err) {
			t.Errorf("%s: got %v, want a permanent error", name, err)
		}
	}
	// A U+FFFD the writer meant, and an escaped surrogate pair, are kept.
	for _, body := range []string{
		`{"id_esdeveniment":"e1","tipus":"t\ufffd","versio":1,"dades":{}}`,
		"{\"id_esdeveniment\":\"e1\",\"tipus\":\"t\uFFFD\",\"versio\":1,\"dades\":{}}",
		`{"id_esdeveniment":"e\ud83d\ude00","tipus":"t","versio":1,"dades":{"x":[1,{"y":"}"}],"z":"a,b"}, "w": 1}`,
	} {
		if _, err := envelope.Decode([]byte(body)); err != nil {
			t.Errorf("%s: refused: %v", body, err)
		}
	}
}
