package outcome_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/km0/km0/outcome"
)

// A handler steers what happens to its message by the error it returns: nil
// is done, a plain error is transient (retried with backoff), RetryAfter
// names the delay, Permanent dead-letters at once, ErrIgnore skips the
// message (the consumer checks it with errors.Is before it classifies).
// Classify is what the consumer reads from any other error; Reason the motiu
// a dead letter carries.
func ExampleClassify() {
	errGateway := errors.New("passarella: 503")
	for _, err := range []error{
		errGateway,
		outcome.RetryAfter(30*time.Second, errGateway),
		outcome.Permanentf("estoc insuficient: %s", "formatge-curat"),
		fmt.Errorf("comanda P-2026-000123: %w", outcome.Permanent(errors.New("adreça buida"))), // survives wrapping
		fmt.Errorf("tipus desconegut: %w", outcome.ErrIgnore),
	} {
		if errors.Is(err, outcome.ErrIgnore) {
			fmt.Printf("%-20s %v\n", "ignored", err)
			continue
		}
		kind, after := outcome.Classify(err, outcome.DefaultClassifier)
		fmt.Printf("%-9s after %-4v %v\n", kind, after, err)
	}
	fmt.Println(outcome.Reason(outcome.KindPermanent, errors.New("estoc insuficient")))
	// Output:
	// transient after 0s   passarella: 503
	// transient after 30s  passarella: 503
	// permanent after 0s   estoc insuficient: formatge-curat
	// permanent after 0s   comanda P-2026-000123: adreça buida
	// ignored              tipus desconegut: outcome: ignore this message
	// permanent: estoc insuficient
}

// A Classifier decides the errors that carry no outcome: here a refusal of
// the payment gateway is permanent, anything else stays transient.
func ExampleClassifier() {
	errDeclined := errors.New("targeta rebutjada")
	classify := func(err error) outcome.Kind {
		if errors.Is(err, errDeclined) {
			return outcome.KindPermanent
		}
		return outcome.DefaultClassifier(err)
	}
	for _, err := range []error{fmt.Errorf("cobrament: %w", errDeclined), errors.New("timeout")} {
		kind, _ := outcome.Classify(err, classify)
		fmt.Println(kind, "←", err)
	}
	// Output:
	// permanent ← cobrament: targeta rebutjada
	// transient ← timeout
}
