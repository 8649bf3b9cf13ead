package schema_test

import (
	"fmt"

	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
)

// The producer side: the outbox refuses an event that does not match its
// schema, naming the field.
func ExampleRegistry_Validate() {
	reg, err := schema.Default()
	if err != nil {
		panic(err)
	}
	_ = outbox.New(outbox.Config{Validate: reg.Validate}) // what a producer configures

	err = reg.Validate("comanda.creada", 2, []byte(`{"id":"P-2026-000123","client":"anna","mercat":"girona",
		"linies":[{"producte":"formatge-curat","quantitat":0,"preu_centims":1450}]}`))
	fmt.Println(err)
	// Output: esquema: comanda.creada v2: /linies/0/quantitat: must be >= 1 (got 0)
}

// The consumer side: inventari is written against comanda.creada v2 and
// receives v1 events upcast; repartiment needs the delivery address, so an
// order from before addresses existed is a permanent "esquema" failure, the
// reader's KeyError: 'adreca_lliurament', dead-lettered instead of crashing.
func ExampleDecoder() {
	inventari, err := schema.NewDecoder(schema.DecoderConfig{
		Handles:   map[string]int{"comanda.creada": 2},
		Upcasters: map[schema.Key]schema.Upcaster{{Type: "comanda.creada", Version: 1}: schema.Bump},
	})
	if err != nil {
		panic(err)
	}
	v1 := []byte(`{"id_esdeveniment":"6f1c9e2a-0000-4000-8000-000000000001","tipus":"comanda.creada","versio":1,
		"dades":{"id":"P-2026-000123","client":"anna","mercat":"girona",
		"linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450}]}}`)
	env, err := inventari.Decode(v1)
	fmt.Println(env.Type, env.Version, err)

	repartiment, err := schema.NewDecoder(schema.DecoderConfig{
		Handles: map[string]int{"comanda.pagada": 1},
		Require: map[string]string{"comanda.pagada": `{"required": ["adreca_lliurament"]}`},
	})
	if err != nil {
		panic(err)
	}
	_, err = repartiment.Decode([]byte(`{"id_esdeveniment":"6f1c9e2a-0000-4000-8000-000000000002","tipus":"comanda.pagada","versio":1,
		"dades":{"comanda_id":"P-2026-000123","import_centims":2900}}`))
	fmt.Println(err)
	_, err = repartiment.Decode([]byte(`{"id_esdeveniment":"6f1c9e2a-0000-4000-8000-000000000003","tipus":"comanda.pagada","versio":2,"dades":{}}`))
	fmt.Println(err)
	// Output:
	// comanda.creada 2 <nil>
	// esquema: comanda.pagada v1 (consumer's requirement): /adreca_lliurament: required field missing
	// esquema: versio 2 not supported
}
