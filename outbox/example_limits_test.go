package outbox_test

import (
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
)

// What Enqueue refuses (with an error wrapping ErrInvalid): a payload over
// Config.MaxPayloadBytes, a header name over MaxHeaderNameBytes, headers
// over MaxHeadersBytes in all; and, with Config.Validate, a payload its
// schema refuses. A WAL-mode outbox looks at its slot at most every
// SlotCheckInterval.
func ExampleConfig_limits() {
	reg, err := schema.Default()
	if err != nil {
		fmt.Println(err)
		return
	}
	var validate outbox.Validator = reg.Validate
	_ = outbox.New(outbox.Config{Validate: validate})
	fmt.Println("MaxPayloadBytes", outbox.MaxPayloadBytesDefault)
	fmt.Println("header name", outbox.MaxHeaderNameBytes, "all headers", outbox.MaxHeadersBytes)
	fmt.Println("SlotCheckInterval", outbox.SlotCheckIntervalDefault)
	// Output:
	// MaxPayloadBytes 1044480
	// header name 255 all headers 8192
	// SlotCheckInterval 1s
}

// The content of the logical decoding message a WAL-mode outbox writes
// for an event (docs/contract.md), what the CDC relay decodes.
func ExampleEncodeWAL() {
	b, err := outbox.EncodeWAL(&outbox.Row{
		ID:        uuid.MustParse("6f1c9e2a-0000-4000-8000-000000000001"),
		Aggregate: "comanda", AggregateID: "P-2026-000123", Type: "comanda.creada", Version: 2,
		Payload:   []byte(`{"id":"P-2026-000123"}`),
		CreatedAt: time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC),
	})
	fmt.Println(string(b), err)
	// Output:
	// {"v":1,"id":"6f1c9e2a-0000-4000-8000-000000000001","agregat":"comanda","agregat_id":"P-2026-000123","tipus":"comanda.creada","versio":2,"creat_en":"2026-03-01T09:00:00.000000Z","carrega":{"id":"P-2026-000123"}} <nil>
}
