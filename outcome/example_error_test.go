package outcome_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/km0/km0/outcome"
)

// Transient, Permanent and RetryAfter wrap their error in an *outcome.Error;
// errors.As reads the Kind and the Delay back, and Unwrap the cause.
func ExampleError() {
	err := fmt.Errorf("cobrament: %w", outcome.RetryAfter(time.Minute, errors.New("passarella: 429")))
	var oe *outcome.Error
	if errors.As(err, &oe) {
		fmt.Println(oe.Kind == outcome.KindTransient, oe.Delay, oe.Err)
	}
	// Output:
	// true 1m0s passarella: 429
}
