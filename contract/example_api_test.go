package contract_test

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/km0/km0/contract"
)

// The headers of a dead letter, as both transports write them: the attempt
// history keeps the last MaxHistory attempts, each error cut to
// MaxHistoryError bytes.
func ExampleCopyHeaders() {
	now := time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)
	var headers []contract.KV = contract.CopyHeaders(contract.Failure{
		Dead: true, Attempt: 1, LastError: "estoc_insuficient: formatge-curat (1 left, 2 asked)",
		Reason: "permanent: estoc_insuficient: formatge-curat (1 left, 2 asked)",
		Origin: "comandes.esdeveniments", Partition: 5, Offset: 120, Group: "inventari.descompte_estoc", Now: now,
	})
	for _, h := range headers {
		if h.Key == contract.HeaderHistory {
			fmt.Println(h.Key, len(contract.ParseHistory(h.Value)))
			continue
		}
		fmt.Println(h.Key, h.Value)
	}
	long := contract.FormatHistory([]contract.FailedAttempt{{N: 1, At: now, Error: strings.Repeat("x", 500)}})
	fmt.Println(len(contract.ParseHistory(long)[0].Error) == contract.MaxHistoryError, contract.MaxHistory)
	// Output:
	// intents 1
	// ultim_error estoc_insuficient: formatge-curat (1 left, 2 asked)
	// motiu permanent: estoc_insuficient: formatge-curat (1 left, 2 asked)
	// topic_original comandes.esdeveniments
	// particio_original 5
	// offset_original 120
	// primera_fallada 1772355600.000000
	// grup_consumidor inventari.descompte_estoc
	// mort_en 1772355600.000000
	// historial_intents 1
	// true 10
}

// A time header that is not a unix time wraps ErrNotTime; tipus headers that
// disagree with the envelope wrap ErrTypeMismatch, a schema failure.
func ExampleParseTime() {
	t, err := contract.ParseTime("1772355600.5")
	fmt.Println(t.UTC().Format(time.RFC3339Nano), err)
	_, err = contract.ParseTime("ahir")
	fmt.Println(errors.Is(err, contract.ErrNotTime))
	var h contract.TypeHeader
	h.Add("comanda.creada")
	fmt.Println(errors.Is(h.Check("comanda.pagada"), contract.ErrTypeMismatch))
	// Output:
	// 2026-03-01T09:00:00.5Z <nil>
	// true
	// true
}

// The idempotency key of a copy of a dual-published pair is its correlacio,
// unless that could not be a key (longer than MaxKeyBytes, a NUL byte).
func ExampleIdempotencyKey() {
	fmt.Println(contract.IdempotencyKey("6f1c9e2a-0001", []byte(`"pair-7"`)))
	fmt.Println(contract.IdempotencyKey("6f1c9e2a-0001", []byte(`"`+strings.Repeat("k", contract.MaxKeyBytes+1)+`"`)))
	// Output:
	// pair-7
	// 6f1c9e2a-0001
}
