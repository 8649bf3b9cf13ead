package strictjson_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/km0/km0/internal/strictjson"
)

type line struct {
	Product  string `json:"producte"`
	Quantity int    `json:"quantitat"`
}

type address struct {
	City string `json:"ciutat"`
}

type order struct {
	ID      string          `json:"id"`
	Client  string          `json:"client"`
	Lines   []line          `json:"linies"`
	Address *address        `json:"adreca_lliurament,omitempty"`
	Extra   json.RawMessage `json:"extra,omitempty"`
	Tags    map[string]int  `json:"etiquetes,omitempty"`
}

type view struct {
	order
	State string `json:"estat"`
}

// TestRefused: each body encoding/json accepts, reading it differently from
// other decoders, is refused with the path of the offending member.
func TestRefused(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, body, path, reason string
	}{
		{"raw invalid UTF-8", "{\"id\":\"P\",\"client\":\"an\xff\xfena\"}", "client", "UTF-8"},
		{"invalid UTF-8 in a line", "{\"linies\":[{\"producte\":\"ok\"},{\"producte\":\"x\xc3\"}]}", "linies[1].producte", "UTF-8"},
		{"escaped lone high surrogate", `{"client":"a\ud800b"}`, "client", "surrogate"},
		{"escaped lone low surrogate", `{"client":"\udc00"}`, "client", "surrogate"},
		{"high surrogate then a non-surrogate escape", `{"client":"\ud800\u0041"}`, "client", "surrogate"},
		{"high surrogate at the end", `{"client":"\ud83d"}`, "client", "surrogate"},
		{"duplicate member", `{"id":"P-2026-000134","id":"P-2026-999999"}`, "id", "repeated member"},
		{"duplicate through an escape", `{"id":"a","\u0069d":"b"}`, "id", "repeated member"},
		{"case variant of a field", `{"id":"P-2026-000134","ID":"P-2026-999999"}`, "ID", "case-sensitive"},
		{"case variant alone", `{"Client":"anna"}`, "Client", "case-sensitive"},
		{"nested case variant", `{"adreca_lliurament":{"Ciutat":"Girona"}}`, "adreca_lliurament.Ciutat", "case-sensitive"},
		{"duplicate in an unknown member", `{"desconegut":{"a":1,"a":2}}`, "desconegut.a", "repeated member"},
		{"duplicate in a raw member", `{"extra":{"a":1,"a":2}}`, "extra.a", "repeated member"},
		{"duplicate map key", `{"etiquetes":{"a":1,"a":2}}`, "etiquetes.a", "repeated member"},
		{"embedded struct field case", `{"Id":"x"}`, "Id", "case-sensitive"},
		{"malformed", `{"id":`, "", "malformed JSON"},
		{"trailing data", `{"id":"a"} {}`, "", "malformed JSON"},
		{"wrong type", `{"linies":[{"quantitat":"dos"}]}`, "linies.quantitat", "wrong type: expected an integer, got string"},
	}
	for _, c := range cases {
		var v any = &order{}
		if strings.HasPrefix(c.name, "embedded") {
			v = &view{}
		}
		err := strictjson.Unmarshal([]byte(c.body), v)
		var se *strictjson.Error
		if !errors.As(err, &se) || se.Path != c.path || !strings.Contains(se.Reason, c.reason) {
			t.Errorf("%s: got %v, want an *Error at %q saying %q", c.name, err, c.path, c.reason)
		}
	}
}

// TestKelvinFold: encoding/json folds U+212A (Kelvin sign) to k; a member
// "\u212a" would fill a field named "k", so it is refused like "K".
func TestKelvinFold(t *testing.T) {
	t.Parallel()
	var v struct {
		K int `json:"k"`
	}
	if err := json.Unmarshal([]byte("{\"\u212a\":7}"), &v); err != nil || v.K != 7 {
		t.Fatalf("premise: encoding/json should fill k from the Kelvin sign, got %v %+v", err, v)
	}
	var se *strictjson.Error
	if err := strictjson.Unmarshal([]byte("{\"\u212a\":7}"), &v); !errors.As(err, &se) {
		t.Fatalf("got %v, want refused", err)
	}
}

// TestAccepted: what is well formed decodes as encoding/json decodes it.
func TestAccepted(t *testing.T) {
	t.Parallel()
	body := `{"id":"P-2026-000134","client":"Júlia \ud83d\ude00 \u00e9","linies":[{"producte":"carbasso","quantitat":2,"desconegut":[1,{"a":null}]}],` +
		`"adreca_lliurament":{"ciutat":"Girona"},"extra":{"b":true},"etiquetes":{"a":1,"A":2},"altre":"x"}`
	var got order
	if err := strictjson.Unmarshal([]byte(body), &got); err != nil {
		t.Fatal(err)
	}
	var want order
	_ = json.Unmarshal([]byte(body), &want)
	g, _ := json.Marshal(got)
	w, _ := json.Marshal(want)
	if string(g) != string(w) || got.Client != "Júlia 😀 é" {
		t.Fatalf("got %s, want %s", g, w)
	}
	var v view
	if err := strictjson.Unmarshal([]byte(`{"id":"x","estat":"creada"}`), &v); err != nil || v.ID != "x" || v.State != "creada" {
		t.Fatalf("embedded: %v %+v", err, v)
	}
	var a []any
	if err := strictjson.Unmarshal([]byte(` [1, "a", {"x": [true]}] `), &a); err != nil || len(a) != 3 {
		t.Fatalf("array: %v %v", err, a)
	}
}

func TestUnknownDisallowed(t *testing.T) {
	t.Parallel()
	var o order
	err := strictjson.Options{DisallowUnknownFields: true}.Unmarshal([]byte(`{"id":"a","altre":1}`), &o)
	var se *strictjson.Error
	if !errors.As(err, &se) || se.Path != "altre" {
		t.Fatalf("got %v, want altre refused", err)
	}
}

func TestDepth(t *testing.T) {
	t.Parallel()
	deep := strings.Repeat("[", strictjson.MaxDepth+2) + strings.Repeat("]", strictjson.MaxDepth+2)
	var v any
	if err := strictjson.Unmarshal([]byte(deep), &v); err == nil {
		t.Fatal("accepted nesting beyond MaxDepth")
	}
}

// A refused body leaves the target as it was, even when encoding/json would
// have filled part of it (a type error further on).
func TestRefusedBodyLeavesTheTargetAlone(t *testing.T) {
	t.Parallel()
	o := order{ID: "abans"}
	for _, body := range []string{`{"id":"P","id":"Q"}`, `{"id":"P","linies":[{"quantitat":"x"}]}`, `{"id":"P","client":"\udfff"}`} {
		if err := strictjson.Unmarshal([]byte(body), &o); err == nil || o.ID != "abans" {
			t.Fatalf("%s: %v, target %+v", body, err, o)
		}
	}
	if err := strictjson.Unmarshal([]byte(`{"id":"P"}`), o); err == nil {
		t.Fatal("a non-pointer target was accepted")
	}
}
