package schema_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/schema"
)

// event encodes an envelope with the given dades (any JSON-marshalable value
// or a JSON string).
func event(t testing.TB, tipus string, versio int, dades any) []byte {
	t.Helper()
	var data []byte
	if s, ok := dades.(string); ok {
		data = []byte(s)
	} else {
		data = mustJSON(t, dades)
	}
	b, err := (&envelope.Envelope{ID: "6f1c9e2a-0000-4000-8000-000000000001", Type: tipus, Version: versio,
		TimeMS: 1789000000000, Origin: "comandes", Data: data}).Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The shapes the km0 handlers are written against: the newest versions.
type (
	adreca struct {
		Ciutat     string `json:"ciutat"`
		CodiPostal string `json:"codi_postal"`
	}
	comandaCreada struct {
		ID     string `json:"id"`
		Client string `json:"client"`
		Mercat string `json:"mercat"`
		Linies []struct {
			Producte    string `json:"producte"`
			Quantitat   int    `json:"quantitat"`
			PreuCentims int    `json:"preu_centims"`
		} `json:"linies"`
		Adreca *adreca `json:"adreca_lliurament"`
	}
	comandaPagada struct {
		ComandaID     string  `json:"comanda_id"`
		ImportCentims int     `json:"import_centims"`
		Mercat        string  `json:"mercat"`
		Adreca        *adreca `json:"adreca_lliurament"`
	}
	estocActualitzat struct {
		Producte  string `json:"producte"`
		Abans     int    `json:"abans"`
		Despres   int    `json:"despres"`
		Motiu     string `json:"motiu"`
		ComandaID string `json:"comanda_id"`
	}
	pagamentConfirmat struct {
		ComandaID     string `json:"comanda_id"`
		ImportCentims int    `json:"import_centims"`
		RefPassarella string `json:"ref_passarella"`
	}
	comandaCancellada struct {
		ComandaID     string `json:"comanda_id"`
		Motiu         string `json:"motiu"`
		Detall        string `json:"detall,omitempty"`
		EstatAnterior string `json:"estat_anterior,omitempty"`
		ImportCentims int    `json:"import_centims,omitempty"`
		Mercat        string `json:"mercat,omitempty"`
	}
	estocRefusat struct {
		ComandaID string `json:"comanda_id"`
		Motiu     string `json:"motiu"`
		Detall    string `json:"detall,omitempty"`
	}
	repartiment struct {
		ComandaID  string `json:"comanda_id"`
		Motiu      string `json:"motiu"`
		Repartidor string `json:"repartidor"`
		Ciutat     string `json:"ciutat"`
	}
	cobertura struct {
		Ciutats []string `json:"ciutats"`
		Revisio int64    `json:"revisio"`
	}
)

// handlersDecoder accepts every km0 tipus at its newest versio, with the
// comanda.creada upcaster: the configuration a km0 service uses.
func handlersDecoder(t testing.TB) *schema.Decoder {
	t.Helper()
	d, err := schema.NewDecoder(schema.DecoderConfig{
		Handles: map[string]int{"comanda.creada": 2, "comanda.pagada": 1, "estoc.actualitzat": 1,
			"pagament.confirmat": 1, "repartiment.rebutjat": 1, "repartiment.assignat": 1,
			"comanda.cancellada": 1, "estoc.refusat": 1},
		Upcasters: map[schema.Key]schema.Upcaster{{Type: "comanda.creada", Version: 1}: schema.Bump},
	})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// Each handler shape gets events with unknown fields everywhere and events
// without any optional field; both decode, and the handler sees the known
// fields with their values and the optional ones absent.
func TestHandlersReadTolerantly(t *testing.T) {
	t.Parallel()
	reg := registry(t)
	d := handlersDecoder(t)
	shapes := map[string]func() any{
		"comanda.creada": func() any { return &comandaCreada{} }, "comanda.pagada": func() any { return &comandaPagada{} },
		"estoc.actualitzat": func() any { return &estocActualitzat{} }, "pagament.confirmat": func() any { return &pagamentConfirmat{} },
		"repartiment.rebutjat": func() any { return &repartiment{} }, "repartiment.assignat": func() any { return &repartiment{} },
		"comanda.cancellada": func() any { return &comandaCancellada{} }, "estoc.refusat": func() any { return &estocRefusat{} },
		"repartiment.cobertura": func() any { return &cobertura{} },
	}
	for k, ex := range examples(t) {
		t.Run(k.String(), func(t *testing.T) {
			for name, dades := range map[string]any{"extra fields": withExtras(ex), "no optional fields": minimal(t, reg, k, ex)} {
				env, err := d.Decode(event(t, k.Type, k.Version, dades))
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if env.Version != reg.Latest(k.Type) {
					t.Fatalf("%s: handler got versio %d", name, env.Version)
				}
				got := shapes[k.Type]()
				if err := env.DataAs(got); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				// The known fields survive; optional ones the event lacks are zero.
				var back map[string]any
				_ = json.Unmarshal(mustJSON(t, got), &back)
				for f, v := range dades.(map[string]any) {
					if bv, known := back[f]; known && !isObjectOrArray(v) && bv != v {
						t.Errorf("%s: field %s = %v, want %v", name, f, bv, v)
					}
				}
			}
		})
	}
	// The tolerant reader's promise made explicit on the contract's example.
	env, err := d.Decode(event(t, "comanda.creada", 1, minimal(t, reg, schema.Key{Type: "comanda.creada", Version: 1}, examples(t)[schema.Key{Type: "comanda.creada", Version: 1}])))
	if err != nil {
		t.Fatal(err)
	}
	var c comandaCreada
	if err := env.DataAs(&c); err != nil || c.Adreca != nil || c.Linies[0].Quantitat != 2 || c.Mercat != "girona" {
		t.Fatalf("v1 comanda as v2: %+v %v", c, err)
	}
}

func isObjectOrArray(v any) bool {
	switch v.(type) {
	case map[string]any, []any:
		return true
	}
	return false
}

func TestDecodeUpcastsV1ToV2(t *testing.T) {
	t.Parallel()
	d := handlersDecoder(t)
	in := event(t, "comanda.creada", 1, examples(t)[schema.Key{Type: "comanda.creada", Version: 1}])
	env, err := d.Decode(in)
	if err != nil {
		t.Fatal(err)
	}
	if env.Version != 2 || env.Type != "comanda.creada" || env.ID != "6f1c9e2a-0000-4000-8000-000000000001" {
		t.Fatalf("upcast envelope %+v", env)
	}
	var c comandaCreada
	if err := env.DataAs(&c); err != nil || c.ID != "P-2026-000123" || c.Adreca != nil {
		t.Fatalf("upcast dades %+v %v", c, err)
	}
	// A v2 event is not touched.
	env, err = d.Decode(event(t, "comanda.creada", 2, examples(t)[schema.Key{Type: "comanda.creada", Version: 2}]))
	if err != nil || env.Version != 2 {
		t.Fatalf("v2: %+v %v", env, err)
	}
	if err := env.DataAs(&c); err != nil || c.Adreca == nil || c.Adreca.Ciutat != "Girona" {
		t.Fatalf("v2 dades %+v %v", c, err)
	}
}

func TestDecodeValidationFailureIsPermanent(t *testing.T) {
	t.Parallel()
	d := handlersDecoder(t)
	cases := map[string]struct {
		in   []byte
		want string
	}{
		"v2 bad quantity": {event(t, "comanda.creada", 2, `{"id":"P-1","client":"a","mercat":"m","linies":[{"producte":"p","quantitat":0,"preu_centims":1}]}`),
			"esquema: comanda.creada v2: /linies/0/quantitat: must be >= 1 (got 0)"},
		"v1 validated before upcast": {event(t, "comanda.creada", 1, `{"id":"P-1","client":"a","mercat":"m","linies":[]}`),
			"esquema: comanda.creada v1: /linies: must have at least 1 item(s) (got 0)"},
		"retyped field": {event(t, "estoc.actualitzat", 1, `{"producte":"p","abans":"5","despres":3,"motiu":"comanda"}`),
			"esquema: estoc.actualitzat v1: /abans: must be integer (got string)"},
		"malformed envelope": {[]byte(`{"tipus":"comanda.creada"}`), "envelope: id_esdeveniment: missing"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			env, err := d.Decode(tc.in)
			if err == nil || env != nil {
				t.Fatalf("accepted: %+v", env)
			}
			if !outcome.IsPermanent(err) || err.Error() != tc.want {
				t.Fatalf("got %q (permanent %v), want permanent %q", err, outcome.IsPermanent(err), tc.want)
			}
			kind, _ := outcome.Classify(err, nil)
			if r := outcome.Reason(kind, err); r != "permanent: "+tc.want {
				t.Fatalf("DLQ motiu %q", r)
			}
		})
	}
}

func TestDecodeUnsupportedVersionIsPermanent(t *testing.T) {
	t.Parallel()
	d := handlersDecoder(t)
	_, err := d.Decode(event(t, "comanda.creada", 3, `{"id":"P-1"}`))
	var ve *schema.VersionError
	if !errors.As(err, &ve) || !outcome.IsPermanent(err) || !errors.Is(err, schema.ErrSchema) {
		t.Fatalf("got %T %v", err, err)
	}
	if err.Error() != "esquema: versio 3 not supported" {
		t.Fatalf("message %q", err)
	}
	if r := outcome.Reason(outcome.KindPermanent, err); r != "permanent: esquema: versio 3 not supported" {
		t.Fatalf("motiu %q", r)
	}
}

// The failure table's row 3: repartiment assumes the address and gets an
// order from before addresses existed. Expressed as repartiment's own
// requirement on comanda.pagada, or as a minimum versio on comanda.creada,
// it is a permanent "esquema: " failure instead of a KeyError.
func TestDecodeConsumerRequirements(t *testing.T) {
	t.Parallel()
	rep, err := schema.NewDecoder(schema.DecoderConfig{
		Handles: map[string]int{"comanda.pagada": 1},
		Require: map[string]string{"comanda.pagada": `{"required": ["adreca_lliurament"]}`},
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = rep.Decode(event(t, "comanda.pagada", 1, `{"comanda_id":"P-1","import_centims":2900}`))
	want := "esquema: comanda.pagada v1 (consumer's requirement): /adreca_lliurament: required field missing"
	if !outcome.IsPermanent(err) || err == nil || err.Error() != want {
		t.Fatalf("got %v, want permanent %q", err, want)
	}
	env, err := rep.Decode(event(t, "comanda.pagada", 1, examples(t)[schema.Key{Type: "comanda.pagada", Version: 1}]))
	if err != nil || env == nil {
		t.Fatalf("order with address refused: %v", err)
	}

	min, err := schema.NewDecoder(schema.DecoderConfig{
		Handles:    map[string]int{"comanda.creada": 2},
		MinVersion: map[string]int{"comanda.creada": 2},
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = min.Decode(event(t, "comanda.creada", 1, examples(t)[schema.Key{Type: "comanda.creada", Version: 1}]))
	if !outcome.IsPermanent(err) || err == nil || err.Error() != "esquema: versio 1 not supported (minimum 2)" {
		t.Fatalf("got %v", err)
	}
	// Require runs on the upcast shape, also with SkipValidation.
	up, err := schema.NewDecoder(schema.DecoderConfig{
		Handles:        map[string]int{"comanda.creada": 2},
		Upcasters:      map[schema.Key]schema.Upcaster{{Type: "comanda.creada", Version: 1}: schema.Bump},
		Require:        map[string]string{"comanda.creada": `{"required": ["adreca_lliurament"]}`},
		SkipValidation: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = up.Decode(event(t, "comanda.creada", 1, examples(t)[schema.Key{Type: "comanda.creada", Version: 1}]))
	if !outcome.IsPermanent(err) || err == nil || err.Error() != "esquema: comanda.creada v2 (consumer's requirement): /adreca_lliurament: required field missing" {
		t.Fatalf("got %v", err)
	}
}

func TestDecodeUpcastFailuresArePermanent(t *testing.T) {
	t.Parallel()
	v1 := examples(t)[schema.Key{Type: "comanda.creada", Version: 1}]
	k1 := schema.Key{Type: "comanda.creada", Version: 1}
	cases := map[string]struct {
		up   schema.Upcaster
		want string
	}{
		"no upcaster": {nil, "esquema: comanda.creada v1: cannot upcast to v2: no upcaster from v1"},
		"failing": {func(*envelope.Envelope) (*envelope.Envelope, error) { return nil, errors.New("boom") },
			"esquema: comanda.creada v1: cannot upcast to v2: upcaster failed: boom"},
		"same versio": {func(e *envelope.Envelope) (*envelope.Envelope, error) { return e, nil },
			"esquema: comanda.creada v1: cannot upcast to v2: upcaster returned a wrong tipus or versio"},
		"invalid result": {schema.DropFields(2, "linies"),
			"esquema: comanda.creada v2 (upcast): /linies: required field missing"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			cfg := schema.DecoderConfig{Handles: map[string]int{"comanda.creada": 2}}
			if tc.up != nil {
				cfg.Upcasters = map[schema.Key]schema.Upcaster{k1: tc.up}
			}
			d, err := schema.NewDecoder(cfg)
			if err != nil {
				t.Fatal(err)
			}
			_, err = d.Decode(event(t, "comanda.creada", 1, v1))
			if !outcome.IsPermanent(err) || !errors.Is(err, schema.ErrSchema) || err.Error() != tc.want {
				t.Fatalf("got %v, want permanent %q", err, tc.want)
			}
		})
	}
}

func TestDecodePassesOtherTipusThrough(t *testing.T) {
	t.Parallel()
	d := handlersDecoder(t)
	env, err := d.Decode(event(t, "producte.afegit", 7, `{"qualsevol":"cosa"}`))
	if err != nil || env.Type != "producte.afegit" || env.Version != 7 {
		t.Fatalf("unhandled tipus: %+v %v", env, err)
	}
	// SkipValidation still checks versions and upcasts, but not the schema.
	skip, err := schema.NewDecoder(schema.DecoderConfig{Handles: map[string]int{"comanda.creada": 2}, SkipValidation: true,
		Upcasters: map[schema.Key]schema.Upcaster{{Type: "comanda.creada", Version: 1}: schema.Bump}})
	if err != nil {
		t.Fatal(err)
	}
	if env, err := skip.Decode(event(t, "comanda.creada", 1, `{"linies":[]}`)); err != nil || env.Version != 2 {
		t.Fatalf("skip validation: %+v %v", env, err)
	}
	if _, err := skip.Decode(event(t, "comanda.creada", 3, `{}`)); err == nil || err.Error() != "esquema: versio 3 not supported" {
		t.Fatalf("skip validation, newer versio: %v", err)
	}
}

func TestNewDecoderRefusesBadConfig(t *testing.T) {
	t.Parallel()
	k := func(v int) schema.Key { return schema.Key{Type: "comanda.creada", Version: v} }
	cases := map[string]schema.DecoderConfig{
		"no handles":             {},
		"unknown tipus":          {Handles: map[string]int{"comanda.esborrada": 1}},
		"unknown versio":         {Handles: map[string]int{"comanda.creada": 5}},
		"upcaster from target":   {Handles: map[string]int{"comanda.creada": 2}, Upcasters: map[schema.Key]schema.Upcaster{k(2): schema.Bump}},
		"upcaster other tipus":   {Handles: map[string]int{"comanda.creada": 2}, Upcasters: map[schema.Key]schema.Upcaster{{Type: "x.y", Version: 1}: schema.Bump}},
		"nil upcaster":           {Handles: map[string]int{"comanda.creada": 2}, Upcasters: map[schema.Key]schema.Upcaster{k(1): nil}},
		"min above target":       {Handles: map[string]int{"comanda.creada": 2}, MinVersion: map[string]int{"comanda.creada": 3}},
		"min for other tipus":    {Handles: map[string]int{"comanda.creada": 2}, MinVersion: map[string]int{"x.y": 1}},
		"require for other":      {Handles: map[string]int{"comanda.creada": 2}, Require: map[string]string{"x.y": `{}`}},
		"require invalid JSON":   {Handles: map[string]int{"comanda.creada": 2}, Require: map[string]string{"comanda.creada": `{`}},
		"require invalid schema": {Handles: map[string]int{"comanda.creada": 2}, Require: map[string]string{"comanda.creada": `{"required":"x"}`}},
	}
	for name, cfg := range cases {
		if _, err := schema.NewDecoder(cfg); !errors.Is(err, schema.ErrConfig) {
			t.Errorf("%s: got %v, want ErrConfig", name, err)
		}
	}
}

func TestDropFields(t *testing.T) {
	t.Parallel()
	e := &envelope.Envelope{ID: "x", Type: "comanda.creada", Version: 2, Data: json.RawMessage(`{"id":"P-1","adreca_lliurament":{"ciutat":"Girona"}}`)}
	out, err := schema.DropFields(1, "adreca_lliurament")(e)
	if err != nil || out.Version != 1 || string(out.Data) != `{"id":"P-1"}` || e.Version != 2 || strings.Contains(string(out.Data), "adreca") == true {
		t.Fatalf("%+v %v (input %+v)", out, err, e)
	}
	if _, err := schema.DropFields(1)(&envelope.Envelope{Data: json.RawMessage(`[1]`)}); err == nil {
		t.Fatal("non-object dades accepted")
	}
}
