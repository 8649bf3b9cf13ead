package envelope_test

import (
	"errors"
	"fmt"

	"github.com/km0/km0/envelope"
)

// Every decoding error matches ErrDecode; errors.As gives the member that is
// wrong and why, e.g. for the dead letter's motiu detail.
func ExampleDecodeError() {
	_, err := envelope.Decode([]byte(`{"id_esdeveniment":"x","tipus":"","versio":1,"dades":{}}`))
	var de *envelope.DecodeError
	if errors.As(err, &de) {
		fmt.Printf("%s: %s\n", de.Field, de.Reason)
	}
	fmt.Println(errors.Is(err, envelope.ErrDecode))
	// Output:
	// tipus: empty
	// true
}
