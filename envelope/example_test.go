package envelope_test

import (
	"fmt"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outcome"
)

// Decoding is strict about the contract and keeps what it does not know.
func Example() {
	e, err := envelope.Decode([]byte(`{"id_esdeveniment":"6f1c9e2a","tipus":"comanda.creada","versio":2,` +
		`"data_ms":1789000000000,"origen":"comandes","dades":{"id":"P-2026-000123"},"camp_nou":true}`))
	fmt.Println(e.Type, e.Version, string(e.Data), string(e.Extra["camp_nou"]), err)

	_, err = envelope.Decode([]byte(`{"id_esdeveniment":"x","tipus":"comanda.creada","versio":"2","dades":{}}`))
	fmt.Println(err, outcome.IsPermanent(err))
	// Output:
	// comanda.creada 2 {"id":"P-2026-000123"} true <nil>
	// envelope: versio: must be a positive integer, got "2" true
}
